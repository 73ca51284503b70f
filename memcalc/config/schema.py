"""A model's shape and knobs, validated once, from flags or a YAML file.

Each field is declared once, as a dataclass field whose metadata holds its
pydantic-core schema (type, range, allowed values) and its help text. pydantic's
validation engine checks a mapping against those schemas, rejecting unknown
keys, before the dataclass is built; `check_divisibility` and `check_layout`
then check the rules that tie fields together, naming the equation with its
values. Everything raises `ConfigError` with a one-line message.

Why pydantic-core and not a `pydantic.BaseModel`: `memcalc estimate` runs in
loops, and importing pydantic's model layer and building the models costs about
0.3 s of CPU per process here, half the start-up budget; pydantic-core alone a
third of that, and only when a value is not plainly valid (`memcalc.config.core`).
"""

from __future__ import annotations

import os
from dataclasses import MISSING, asdict, field, fields, replace
from functools import lru_cache
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memcalc.config import core as cs
from memcalc.config.files import parse_yaml, read_capped
from memcalc.config.shipped import locate, shipped_names
from memcalc.errors import ConfigError, in_file
from memcalc.model.impls import IMPLEMENTATIONS, implementation
from memcalc.model.knobs import BY_NAME as KNOBS_BY_NAME
from memcalc.model.knobs import Knobs
from memcalc.model.rules import DIVISIBILITY, EXPERT_RULES, divides
from memcalc.records import record
from memcalc.text import printable, short_repr
from memcalc.units import minimum

if TYPE_CHECKING:
    from pydantic_core import SchemaValidator, ValidationError


def _field(schema: cs.Schema, default: Any, help: str) -> Any:
    return field(default=default, metadata={"schema": schema, "help": help})


# Sizes are int64 in every framework; the bound also keeps every byte count a float can show.
_SIZE_LIMIT = 2**63
# A factor (a capacity factor: 1 to 4 in practice) times a size stays a finite float far below this;
# 1e308 would make c*k*b*s infinite, and a size NaN.
_FACTOR_LIMIT = 1e6


def _size(help: str, default: Any = MISSING) -> Any:
    """A positive integer; required unless a default is given."""
    return _field(cs.int_schema(gt=0, lt=_SIZE_LIMIT), default, help)


def _optional_size(help: str, minimum: int = 1) -> Any:
    """A positive integer (at least `minimum`) or None, which means "derive it"."""
    bound = {"gt": 0} if minimum == 1 else {"ge": minimum}
    return _field(cs.nullable_schema(cs.int_schema(lt=_SIZE_LIMIT, **bound)), None, help)


def _choice(default: str, *values: str, help: str) -> Any:
    return _field(cs.literal_schema([default, *values]), default, help)


# Each kind of knob's validation rule but a choice's (its values); a name's are memcalc.model.families', checked
# with the knobs (impls.implementation).
_KNOB_SCHEMAS = {
    "name": cs.nullable_schema(cs.str_schema()), "size": cs.nullable_schema(cs.int_schema(gt=0, lt=_SIZE_LIMIT)),
    "count": cs.nullable_schema(cs.int_schema(ge=0, lt=_SIZE_LIMIT)), "probability": cs.float_schema(ge=0.0, lt=1.0),
    "factor": cs.nullable_schema(cs.float_schema(gt=0.0, le=_FACTOR_LIMIT, allow_inf_nan=False)),
    "flag": cs.bool_schema(),
}


def _schema(f: Any) -> cs.Schema:
    """A field's schema: a knob's from its kind in the knob table, any other field's from its metadata."""
    knob = f.metadata.get("knob")
    if knob is None:
        return f.metadata["schema"]
    if knob.kind == "choice":
        return cs.after_schema(knob.choices, cs.literal_schema(list(knob.values)))
    return _KNOB_SCHEMAS[knob.kind]


def _flag(default: bool, help: str) -> Any:
    return _field(cs.bool_schema(), default, help)


def _text(help: str) -> Any:
    return _field(cs.nullable_schema(cs.str_schema()), None, help)


@record(kw_only=True)
class ModelConfig(Knobs):
    """One transformer and one parallel layout."""

    name: str | None = _text("a short name for the model")
    description: str | None = _text("a line describing the model")

    b: int = _size("micro-batch size", 1)
    s: int = _size("sequence length")
    h: int = _size("hidden size")
    a: int = _size("attention heads")
    t: int = _size("tensor-parallel size", 1)
    L: int = _size("transformer layers", 1)

    # The model's ends and its parameters (memcalc.sizing.states, memcalc.sizing.totals); Megatron-LM's names.
    vocab_size: int = _size("vocabulary v (the paper's 51200)", 51200)
    tie_embeddings: bool = _flag(True, "the output layer reuses the input embedding")
    position_embedding_type: str = _choice("learned_absolute", "rope", "alibi", help="position embedding")
    max_position_embeddings: int | None = _optional_size("learned table rows; default s")
    add_bias_linear: bool = _flag(True, "biases on QKV, projection, fc1 and fc2")
    add_qkv_bias: bool = _flag(False, "a QKV bias even without add_bias_linear (Qwen2)")

    # The parallel layout beyond t (memcalc.sizing.pipeline, memcalc.sizing.totals).
    pp: int = _size("pipeline stages", 1)
    vpp: int | None = _optional_size("interleaved model chunks per stage", minimum=2)
    dp: int = _size("data-parallel size", 1)
    cp: int = _size("context-parallel size", 1)
    ep: int = _size("expert-parallel size: each rank holds num_experts/ep experts", 1)
    etp: int | None = _optional_size("expert tensor-parallel size (default t; memcalc models etp = t)")
    distributed_optimizer: bool = _flag(False, "shard optimizer states over dp*cp")
    # Data-parallel sharding as torchtitan and transformers' Trainer run it (memcalc.sizing.states.sharding).
    dp_shard: int | None = _optional_size("FSDP2 (fully_shard) over this many data-parallel ranks (torchtitan's"
                                          " data_parallel_shard_degree); default: no FSDP")
    dp_replicate: int | None = _optional_size("HSDP: FSDP2 groups that replicate each other (default dp/dp_shard)")
    reshard_after_forward: bool = _flag(True, "FSDP2 frees each block's gathered parameters after its forward and"
                                              " gathers them again for backward (not under torchtitan's pipeline:"
                                              " its default policy keeps them, and so does the model)")
    reduce_dtype: str = _choice("fp32", "bf16", help="FSDP2's MixedPrecisionPolicy reduce_dtype: the gradients'"
                                " dtype in the reduce-scatter (param_dtype is dtype)")
    zero_stage: int | None = _field(cs.nullable_schema(cs.int_schema(strict=True, ge=0, le=3)), None,
                                    "DeepSpeed ZeRO stage 0..3 under transformers' Trainer (impl hf); default: none")
    gpus: int | None = _optional_size("GPUs in the job; dp is then derived as gpus/(t*pp*cp)")
    num_microbatches: int | None = _optional_size("micro-batches per step on each data-parallel rank")
    global_batch_size: int | None = _optional_size("sequences per step; micro-batches = global_batch_size/(dp*b)")
    make_vocab_size_divisible_by: int = _size("Megatron-LM pads v up to a multiple of this times t", 128)

    @property
    def ffn(self) -> int:
        """The MLP's hidden size: 4h unless the config sets it."""
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.h

    @property
    def groups(self) -> int:
        """K/V head groups: a (plain multi-head) unless the config sets fewer."""
        return self.num_query_groups if self.num_query_groups is not None else self.a

    @property
    def head_dim(self) -> int:
        """Channels of each attention head: kv_channels, else h/a."""
        return self.kv_channels if self.kv_channels is not None else self.h // self.a

    @property
    def expert_ffn(self) -> int:
        """One expert's MLP hidden size: moe_ffn_hidden_size, else the dense MLP's."""
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn

    @property
    def layer_inputs_cast(self) -> bool:
        """Whether FSDP2's mixed precision casts every floating tensor a sharded layer is called with (dp_shard set):
        the layout `estimate` puts in its Accounting, and the step walk reads (OLMo's cast RoPE tables)."""
        return self.dp_shard is not None

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i (0-based) has a MoE MLP: past the first moe_first_dense_layers (DeepSeek's
        first_k_dense_replace), every moe_layer_freq-th, counted as the implementation counts: i % freq == 0
        (Megatron-LM's moe_layer_freq), (i + 1) % freq == 0 under impl hf (Qwen2-MoE's decoder_sparse_step).
        `moe_layers` counts them."""
        first, shift = self.moe_first_dense_layers or 0, int(self.impl == "hf")
        return self.num_experts is not None and i >= first and (i + shift) % self.moe_layer_freq == 0

    def rank_chunks(self, rank: int) -> list[range]:
        """The layers of each model chunk pipeline rank `rank` holds: torchtitan's one contiguous share
        (`torchtitan_split`), else Megatron-LM's model chunks (`megatron_chunk_layers`) laid end to end in its
        order, chunk c*pp + rank for each of the vpp (interleaved 1F1B; one without)."""
        pp = self.pp
        if self.impl == "torchtitan" and pp > 1:
            split = torchtitan_split(self.L, pp)
            return [range(sum(split[:rank]), sum(split[:rank + 1]))]
        starts = [0, *accumulate(megatron_chunk_layers(self))]
        return [range(starts[c * pp + rank], starts[c * pp + rank + 1]) for c in range(self.vpp or 1)]

    @property
    def moe_layers(self) -> int:
        """Layers with a MoE MLP, as `is_moe_layer` picks them; 0 if dense."""
        if self.num_experts is None:
            return 0
        every, first = self.moe_layer_freq, minimum(self.moe_first_dense_layers or 0, self.L)  # L: or a sweep's array
        shift = int(self.impl == "hf")
        return -(-(self.L + shift) // every) - -(-(first + shift) // every)  # multiples of freq in [first, L) + shift

    @property
    def positions(self) -> int:
        """Rows of a learned position table: max_position_embeddings, else s."""
        return self.max_position_embeddings if self.max_position_embeddings is not None else self.s

    @property
    def microbatches(self) -> int | None:
        """Micro-batches per step: num_microbatches, or global_batch_size/(dp*b); None if neither is given."""
        if self.num_microbatches is not None:
            return self.num_microbatches
        if self.global_batch_size is not None:
            return self.global_batch_size // (self.dp * self.b)
        return None

    def as_dict(self, exclude_none: bool = False) -> dict[str, Any]:
        """The fields as a plain mapping (for JSON, or to build a changed config)."""
        return {k: v for k, v in asdict(self).items() if not (exclude_none and v is None)}


def torchtitan_split(L: int, pp: int) -> list[int]:
    """The layers of each rank of torchtitan's pipeline: its pipeline_llm splits the model by
    _generate_llm_fqn_per_model_part, which counts the embedding and the output as a layer each (its
    first_stage_less_layers and last_stage_less_layers, 1 by default) and gives each rank (L + 2)/pp of them, the
    first ranks one more where it does not divide."""
    per, extra = divmod(L + 2, pp)
    return [per + (r < extra) - (r == 0) - (r == pp - 1) for r in range(pp)]


# One layer's sizes, in the order flags, sweeps and tables list them.
SIZES = ("b", "s", "h", "a", "t", "L")
EXPERT_AXES = ("num_experts", "moe_router_topk", "ep")  # a sweep's axes beside SIZES when its model has experts


def config_record(config: ModelConfig) -> dict[str, Any]:
    """The config for JSON output, with the MLP width and K/V groups as used."""
    return config.as_dict(exclude_none=True) | {"ffn_hidden_size": config.ffn, "num_query_groups": config.groups}


def field_default(name: str) -> Any:
    """A field's default, or None for a required one."""
    default = next(f.default for f in fields(ModelConfig) if f.name == name)
    return None if default is MISSING else default


def field_names(cls: type[Knobs] = ModelConfig) -> list[str]:
    """The fields a config (or knob set) accepts, in declaration order."""
    return [f.name for f in fields(cls)]


def field_help(name: str) -> str:
    """One field's help text."""
    return next(f.metadata["help"] for f in fields(ModelConfig) if f.name == name)


def choices(name: str) -> tuple[str, ...]:
    """The values a choice field allows, default first."""
    knob = KNOBS_BY_NAME.get(name)
    if knob is not None:
        return knob.values
    schema = next(f.metadata["schema"] for f in fields(ModelConfig) if f.name == name)
    return tuple(schema["expected"])


@lru_cache(maxsize=None)
def class_schema(cls: type[Knobs]) -> cs.Schema:
    """The pydantic-core schema of a config (or knob set): its fields' schemas, no other keys."""
    return cs.typed_dict_schema({f.name: (_schema(f), f.default is MISSING) for f in fields(cls)})


@lru_cache(maxsize=None)
def _validator(cls: type[Knobs]) -> SchemaValidator:
    """One pydantic-core validator per class (imported only for a value the plain check is unsure of)."""
    from pydantic_core import SchemaValidator

    return SchemaValidator(class_schema(cls))


def with_library_defaults(fields: dict[str, Any], knobs_only: bool = False) -> dict[str, Any]:
    """`fields` over the chosen implementation's own defaults (HF Llama has no dropout, say), and over a named
    transformers family's fixed values (GPT-2's Conv1Ds have biases, its positions are learned): every one, or for a
    knob set only the knobs' (a library's bias or position default is a config field, not a knob)."""
    impl = IMPLEMENTATIONS.get(fields.get("impl")) if isinstance(fields.get("impl"), str) else None
    if impl is None:
        return fields
    defaults = impl.knob_defaults() if knobs_only else impl.defaults
    return defaults | ({} if knobs_only else _family_fixed(fields)) | fields


def _family_fixed(fields: dict[str, Any]) -> dict[str, Any]:
    """The config fields (positions, biases: not knobs) a named transformers family fixes (families.Family.fixed),
    which its layer's code has whatever the config says (Qwen2's q, k and v biases too, which no flag sets); its picks
    (fused_qkv, alibi, ...) stay the config's, checked by check_family."""
    from memcalc.model.families import FAMILIES

    family = FAMILIES.get(fields.get("family")) if isinstance(fields.get("family"), str) else None
    fixed = family.fixed if family is not None and fields.get("impl") == "hf" else {}
    return {k: v for k, v in fixed.items() if k not in KNOBS_BY_NAME}


def build_config(fields: dict[str, Any]) -> ModelConfig:
    """Validate `fields` into a config, or raise ConfigError naming the field and rule."""
    config = derive_shards(derive_dp(validate_fields(fields), dp_given="dp" in fields), dp_given="dp" in fields)
    check_divisibility(config)
    check_layout(config)
    return config


def derive_dp(config: ModelConfig, dp_given: bool) -> ModelConfig:
    """With `gpus`, dp is what the other parallel sizes leave: gpus/(t*pp*cp), which must be whole.

    A dp given as well must agree; one left out is derived. Without `gpus`, the config is unchanged.
    """
    c = config
    if c.gpus is None:
        return c
    model = c.t * c.pp * c.cp
    if c.gpus % model:
        raise ConfigError(
            f"gpus={c.gpus} is not divisible by t*pp*cp={c.t}*{c.pp}*{c.cp}={model}"
            f" (dp = gpus/(t*pp*cp) must be whole; {c.gpus % model} GPUs left over)"
        )
    dp = c.gpus // model
    if dp_given and c.dp != dp:
        raise ConfigError(
            f"t*pp*cp*dp={c.t}*{c.pp}*{c.cp}*{c.dp}={model * c.dp} is not gpus={c.gpus}"
            f" (leave dp out to derive it: {dp})"
        )
    return replace(c, dp=dp)


def derive_shards(config: ModelConfig, dp_given: bool) -> ModelConfig:
    """FSDP2's mesh: dp = dp_replicate * dp_shard. dp left out (and no gpus) is that product; dp_replicate left out
    is dp/dp_shard, which must be whole. Without dp_shard, dp_replicate means nothing and is refused."""
    c = config
    if c.dp_shard is None:
        if c.dp_replicate is not None:
            raise ConfigError(f"dp_replicate={c.dp_replicate} needs dp_shard (HSDP replicates FSDP2 groups of dp_shard"
                              " ranks)")
        return c
    if not dp_given and c.gpus is None:
        c = replace(c, dp=c.dp_shard * (c.dp_replicate or 1))
    if c.dp_replicate is None:
        divides(c.dp_shard, "dp_shard", c.dp, "dp", "HSDP's replicas are dp/dp_shard FSDP2 groups")
        return replace(c, dp_replicate=c.dp // c.dp_shard)
    if c.dp_replicate * c.dp_shard != c.dp:
        raise ConfigError(f"dp_replicate*dp_shard={c.dp_replicate}*{c.dp_shard}={c.dp_replicate * c.dp_shard} is not"
                          f" dp={c.dp} (FSDP2's mesh is the data-parallel ranks; leave dp_replicate out to derive it)")
    return c


def validate_fields(fields: dict[str, Any]) -> ModelConfig:
    """Each field by its own rule (type, range, choices) and the implementation's; not the rules between sizes.

    Sweeps call this on one point and apply the rules between sizes point by point.
    """
    config = _validate(ModelConfig, with_library_defaults(fields))
    implementation(config)  # the implementation refuses knobs its library cannot run
    return config


def build_knobs(fields: dict[str, Any]) -> Knobs:
    """Validate knob fields alone, for commands that need no sizes."""
    knobs = _validate(Knobs, with_library_defaults(fields, knobs_only=True))
    implementation(knobs)
    return knobs


def _validate(cls: type[Knobs], values: dict[str, Any]) -> Any:
    bad = [k for k in values if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"invalid config: field names must be text, got {short_repr(bad[0])}")
    plain = cs.plain_values(class_schema(cls), values)
    if plain is not None:
        return cls(**plain)
    from pydantic_core import ValidationError

    try:
        return cls(**_validator(cls).validate_python(values))
    except ValidationError as exc:
        raise ConfigError(_describe(exc, cls)) from None


def check_divisibility(config: ModelConfig) -> None:
    """The rules between fields that any strategy needs; each names its values."""
    for rule in DIVISIBILITY:
        rule.check(config)


# Config fields and layouts (not layer knobs) torchtitan's Llama3 and its pipeline have not: (refused when, why and
# what to do instead), in the order checked.
_TORCHTITAN_REFUSALS: tuple[tuple[Any, str], ...] = (
    (lambda c: c.vpp is not None, "vpp={c.vpp} is Megatron-LM's interleaved schedule; torchtitan's pipeline is"
     " modelled under its default schedule, torch's Schedule1F1B, not its interleaved ones"),
    (lambda c: c.position_embedding_type != "rope", "position_embedding_type {c.position_embedding_type}, but its"
     " Llama3 rotates q and k (RoPE) and has no position table; use impl megatron or hf for a model with one"),
    (lambda c: c.add_bias_linear, "add_bias_linear True is not in torchtitan's Llama3: Llama3's linears have no"
     " biases; use --no-bias-linear (add_bias_linear false)"),
    (lambda c: c.add_qkv_bias, "add_qkv_bias True is not in torchtitan's Llama3: Llama3's wqkv has no bias; use impl"
     " megatron or hf for a model with QKV biases"),
    (lambda c: c.pp > 1 and c.tie_embeddings, "tie_embeddings with pp={c.pp}: its Decoder.update_from_config raises"
     " NotImplementedError (no weight tying under pp); untie the embeddings"),
)


def check_layout(config: ModelConfig) -> None:
    """The rules of pipeline and context parallelism, of a learned position table, and the tensors torchtitan's
    Llama3 has not."""
    c = config
    if c.vpp is not None and c.pp < 2:
        raise ConfigError(f"vpp={c.vpp} needs pp >= 2 (the interleaved schedule splits each stage into vpp chunks)")
    for refused, why in _TORCHTITAN_REFUSALS if c.impl == "torchtitan" else ():
        if refused(c):
            raise ConfigError("impl torchtitan: " + why.format(c=c))
    if c.impl != "torchtitan":  # torchtitan's pipeline_llm splits any L (torchtitan_split)
        check_megatron_split(c)
    elif c.pp > c.L + 2:
        raise ConfigError(f"impl torchtitan: pp={c.pp} above L+2={c.L + 2}: its pipeline_llm counts the embedding and"
                          " the output as a layer each and raises ValueError for a stage with none")
    if c.cp > 1:
        if c.attention != "flash":
            raise ConfigError(
                f"cp={c.cp} needs attention 'flash' (Megatron-LM runs context parallelism only in fused attention,"
                " which never keeps the s x s scores)"
            )
        divides(2 * c.cp, "2*cp", c.s, "s", "each context-parallel rank takes one early and one late chunk of 2*cp")
    if c.global_batch_size is not None:
        why = "each data-parallel rank runs whole micro-batches of b sequences"
        divides(c.dp * c.b, f"dp*b={c.dp}*{c.b}", c.global_batch_size, "global_batch_size", why)
        derived = c.global_batch_size // (c.dp * c.b)
        if c.num_microbatches is not None and c.num_microbatches != derived:
            raise ConfigError(
                f"num_microbatches={c.num_microbatches} is not global_batch_size/(dp*b)"
                f"={c.global_batch_size}/({c.dp}*{c.b})={derived} (give one of them)"
            )
    if c.vpp is not None and c.microbatches is not None:
        why = "Megatron-LM's interleaved schedule runs micro-batches in groups of pp"
        divides(c.pp, "pp", c.microbatches, "num_microbatches", why)
    check_experts(c)
    implementation(c).check_sizes(c)
    check_sharding(c)
    check_sliding_window(c)
    if c.position_embedding_type == "learned_absolute" and c.s > c.positions:
        raise ConfigError(
            f"s={c.s} exceeds max_position_embeddings={c.positions} (a learned table has one row per position)"
        )


_ENDS = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")
_ACCOUNTED = ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
MEGATRON_SPLIT = (*_ENDS, *_ACCOUNTED)  # the knobs of Megatron's split, megatron-core's TransformerConfig's names


def megatron_chunk_layers(config: ModelConfig) -> list[int]:
    """The layers of each of Megatron-LM's model chunks, chunk c of pipeline rank r at c*pp + r, for a layout
    `check_megatron_split` passed (megatron-core's get_num_layers_to_build): L/pp layers a rank, or the first's and
    the last's num_layers_in_*_pipeline_stage and the rest in equal shares between; with account_for_*_in_pipeline
    _split the embedding and the loss count as a layer each, the first chunk's and the last's; each rank's split
    evenly over its vpp chunks."""
    c, chunks = config, config.vpp or 1
    ends = [getattr(c, name) for name in _ENDS]
    accounted = [int(getattr(c, name)) for name in _ACCOUNTED]
    given = [n for n in ends if n is not None]
    middle = (c.L + sum(accounted) - sum(given)) // max(c.pp - len(given), 1)
    ranks = [middle] * c.pp
    ranks[0], ranks[-1] = ends[0] or ranks[0], ends[1] or ranks[-1]
    found = [n // chunks for _ in range(chunks) for n in ranks]
    found[0], found[-1] = found[0] - accounted[0], found[-1] - accounted[1]
    return found


def check_megatron_split(config: ModelConfig) -> None:
    """ConfigError for a split of the layers over Megatron-LM's pipeline stages that megatron-core refuses
    (TransformerConfig.__post_init__'s ValueErrors, get_num_layers_to_build's assertions), in its terms with the
    numbers, or that memcalc does not size: a stage or chunk without layers, the embedding or the loss counted
    under the interleaved schedule (chunks of two sizes on one rank)."""
    c = config
    ends = {name: getattr(c, name) for name in _ENDS if getattr(c, name) is not None}
    accounted = [name for name in _ACCOUNTED if getattr(c, name)]
    chunks, name = (c.pp * c.vpp, f"pp*vpp={c.pp}*{c.vpp}") if c.vpp is not None else (c.pp, "pp")
    if not ends and not accounted:
        divides(chunks, name, c.L, "L", "every pipeline model chunk holds the same number of layers")
        return
    said = ", ".join([*(f"{k}={v}" for k, v in ends.items()), *accounted])
    if c.pp < 2:
        raise ConfigError(f"{said} with pp={c.pp}: a split of the layers over pipeline stages needs pp >= 2")
    if ends and accounted:
        raise ConfigError(f"{said}: megatron-core's TransformerConfig refuses num_layers_in_first/last_pipeline_stage"
                          " with account_for_embedding/loss_in_pipeline_split (ValueError); give one kind")
    if accounted and c.vpp is not None:
        raise ConfigError(f"{said} with vpp={c.vpp}: the first or last rank's model chunks would hold layers of two"
                          " counts, which memcalc's interleaved schedule does not size; leave vpp out")
    _check_shares(c, ends, len(accounted), said)
    if min(megatron_chunk_layers(c)) < 1:
        raise ConfigError(f"{said} with L={c.L}, pp={c.pp}: a pipeline stage would hold no layers, which memcalc"
                          " does not size")


def _check_shares(config: ModelConfig, ends: dict[str, int], accounted: int, said: str) -> None:
    """ConfigError where the layers of an uneven split (the `ends` set, `accounted` ends counted as layers; `said`
    names the knobs) do not fall in whole shares as megatron-core's TransformerConfig asks: each end's over its vpp
    chunks, the rest over the stages between and each of those over its chunks."""
    c = config
    for knob, n in ends.items() if c.vpp is not None else ():
        divides(c.vpp, "vpp", n, knob, "megatron-core's TransformerConfig raises ValueError: each of the stage's"
                " model chunks holds as many layers")
    stages, rest = c.pp - len(ends), c.L + accounted - sum(ends.values())
    if rest < 0 or bool(rest) != bool(stages):
        raise ConfigError(f"{said} with L={c.L}, pp={c.pp}: {rest} layers remain for the {stages} stages between"
                          " (megatron-core's TransformerConfig raises ValueError: every stage between holds layers)")
    if not stages and c.vpp is not None:
        raise ConfigError(f"{said} with pp={c.pp}, vpp={c.vpp}: no stage between the first and the last, and under"
                          " the interleaved schedule megatron-core's get_transformer_layer_offset divides by their"
                          " number (ZeroDivisionError); leave vpp out or use pp >= 3")
    if stages:
        what = "the stages between" if ends else "the stages, the embedding and the loss counted as layers,"
        divides(stages, "stages", rest, "layers", f"megatron-core's TransformerConfig raises ValueError: {what}"
                " hold equal shares")
    if stages and c.vpp is not None:
        divides(c.vpp, "vpp", rest // stages, "layers a stage between", "megatron-core's TransformerConfig raises"
                " ValueError: its model chunks hold equal shares")


# What each stack shards data-parallel states with: (refused when, why), in the order checked.
SHARDING_REFUSALS: tuple[tuple[Any, str], ...] = (
    (lambda c: c.zero_stage is not None and c.impl != "hf",
     "zero_stage={c.zero_stage} is DeepSpeed's ZeRO, which memcalc models under transformers' Trainer (impl hf);"
     " impl {c.impl} shards with {own}"),
    (lambda c: c.dp_shard is not None and c.impl == "megatron",
     "dp_shard={c.dp_shard} under impl megatron: memcalc models Megatron-LM's distributed optimizer"
     " (distributed_optimizer), not its own FSDP"),
    (lambda c: c.dp_shard is not None and c.distributed_optimizer,
     "dp_shard={c.dp_shard} with distributed_optimizer: FSDP2 shards the optimizer's states itself; give one"),
    (lambda c: c.zero_stage is not None and c.distributed_optimizer,
     "zero_stage={c.zero_stage} with distributed_optimizer: ZeRO shards the optimizer's states itself; give one"),
    (lambda c: c.distributed_optimizer and c.impl in ("hf", "torchtitan"),
     "distributed_optimizer is Megatron-LM's (impl megatron); impl {c.impl} shards with {own}"),
    (lambda c: (c.zero_stage or 0) >= 2 and c.pp > 1,
     "zero_stage={c.zero_stage} with pp={c.pp}: DeepSpeed's PipelineEngine asserts ZeRO-2 and ZeRO-3 are"
     " incompatible with pipeline parallelism; use zero_stage 1 or pp 1"),
    (lambda c: c.zero_stage is not None and c.dp_shard is not None,
     "zero_stage={c.zero_stage} with dp_shard={c.dp_shard}: transformers' Trainer runs DeepSpeed or FSDP2, not both"),
    (lambda c: c.dp_shard is None and (not c.reshard_after_forward or c.reduce_dtype != "fp32"),
     "reshard_after_forward and reduce_dtype are FSDP2's: they need dp_shard"),
)
_OWN_SHARDING = {"megatron": "its distributed optimizer (distributed_optimizer)", "torchtitan": "FSDP2 (dp_shard)",
                 "hf": "DeepSpeed's ZeRO (zero_stage) or FSDP2 (dp_shard)"}


def check_sharding(config: ModelConfig) -> None:
    """What a stack cannot shard with, refused in one line (ZeRO is DeepSpeed's, under transformers' Trainer)."""
    for refused, why in SHARDING_REFUSALS:
        if refused(config):
            raise ConfigError(why.format(c=config, own=_OWN_SHARDING.get(config.impl, "")))


def check_sliding_window(config: ModelConfig) -> None:
    """A window shorter than the sequence is counted where it was measured to keep what full causal attention keeps:
    transformers' eager attention, whose mask only adds -inf to the (s, s) scores. Elsewhere the kernel a window
    picks (SDPA with an explicit mask, a windowed flash kernel, Megatron's window_size) is not modelled."""
    c = config
    if c.sliding_window is not None and c.s > c.sliding_window and (c.impl, c.attention) != ("hf", "eager"):
        raise ConfigError(
            f"s={c.s} exceeds sliding_window={c.sliding_window}: memcalc counts a sliding window only under --impl hf"
            " --attention eager (which keeps full causal attention's (s, s) probabilities); give --s"
            f" {c.sliding_window} or less, or --impl hf --attention eager"
        )


def check_experts(config: ModelConfig) -> None:
    """Expert parallelism: ep divides the experts; expert tensor parallelism is t (the one memcalc models)."""
    c = config
    if c.num_experts is None:
        if c.ep > 1 or c.etp is not None:
            raise ConfigError(f"ep={c.ep}, etp={c.etp} need num_experts (a dense MLP has no experts to split)")
        return
    EXPERT_RULES[0].check(c)  # the top-k limit is the knobs' own (rules.check_moe)
    if c.moe_layers == 0:  # ModelConfig.is_moe_layer picks none
        first = f"moe_first_dense_layers={c.moe_first_dense_layers}" if c.moe_first_dense_layers else ""
        freq = f"moe_layer_freq={c.moe_layer_freq}" if c.moe_layer_freq > 1 else ""
        raise ConfigError(f"{' with '.join(x for x in (first, freq) if x)} leaves none of the L={c.L} layers a MoE"
                          " layer (drop num_experts for a dense model)")
    if c.etp is not None and c.etp != c.t:
        raise ConfigError(f"etp={c.etp} is not t={c.t}: memcalc models expert tensor parallelism equal to t"
                          " (Megatron-LM's default); leave etp out")


def load_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML mapping, turning every I/O, size or syntax problem into ConfigError naming the file.

    `path` may also be the name of a shipped config (`gpt3-175b`); messages name it as given.
    """
    found = locate(Path(path))
    if not os.path.exists(found):  # os.path's: False, not OSError, for a name too long
        bare = Path(path).parent == Path(".")  # a bare name may have meant a shipped config
        hint = f" (nor a shipped config: {', '.join(shipped_names())})" if bare else ""
        raise ConfigError(f"config file not found: {path}{hint}")
    text = read_capped(found, "config file")
    with in_file(path):
        data = parse_yaml(text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of fields, got {type(data).__name__}")
    return data


def load_config(path: Path | None, overrides: dict[str, Any], base: dict[str, Any] | None = None) -> ModelConfig:
    """A config from an optional YAML file (or `base`, fields already read from `path`) with flags laid over it."""
    fields = dict(base) if base is not None else load_yaml(path) if path is not None else {}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    with in_file(path):
        return build_config(fields)


def _describe(exc: ValidationError, cls: type[Knobs]) -> str:
    """pydantic's first error as `field 'x': rule (got v)` on one line."""
    err = exc.errors()[0]
    field = printable(".".join(str(p) for p in err["loc"]))[:60] or "config"
    if err["type"] == "extra_forbidden":
        return f"unknown field '{field}' (allowed: {', '.join(field_names(cls))})"
    if err["type"] == "missing":
        return f"field '{field}' is required"
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"field '{field}': {err['msg'].lower()} (got {short_repr(err.get('input'))}){more}"

