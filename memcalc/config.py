"""A model's shape and knobs, validated once, from flags or a YAML file.

pydantic checks each field's type and range and rejects unknown keys;
`check_divisibility` then checks the rules that tie fields together (a head
count that t must divide, and so on), naming the equation with its values.
Everything raises `ConfigError` with a one-line message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from memcalc.errors import ConfigError

Size = Field(strict=True, gt=0)


class ModelKnobs(BaseModel):
    """The choices that decide which tensors a layer saves; defaults are the seed's model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mlp: Literal["gelu", "swiglu"] = "gelu"
    ffn_hidden_size: Optional[int] = Field(None, strict=True, gt=0, description="default 4h")
    attention: Literal["eager", "flash"] = "eager"
    num_query_groups: Optional[int] = Field(None, strict=True, gt=0, description="default a (multi-head)")
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    dropout: float = Field(0.1, strict=True, ge=0.0, lt=1.0, description="0 saves no masks")
    recompute: Literal["none", "selective", "full"] = "none"
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"


class ModelConfig(ModelKnobs):
    """One transformer and one parallel layout."""

    name: Optional[str] = None
    description: Optional[str] = None

    b: int = Field(1, strict=True, gt=0, description="micro-batch size")
    s: int = Field(strict=True, gt=0, description="sequence length")
    h: int = Field(strict=True, gt=0, description="hidden size")
    a: int = Field(strict=True, gt=0, description="attention heads")
    t: int = Field(1, strict=True, gt=0, description="tensor-parallel size")
    L: int = Field(1, strict=True, gt=0, description="transformer layers")

    # The model's ends and its parameters (memcalc.states, memcalc.totals); Megatron-LM's names.
    vocab_size: int = Field(51200, strict=True, gt=0, description="vocabulary v (the paper's 51200)")
    tie_embeddings: bool = Field(True, strict=True, description="the output layer reuses the input embedding")
    position_embedding_type: Literal["learned_absolute", "rope"] = "learned_absolute"
    max_position_embeddings: Optional[int] = Field(None, strict=True, gt=0, description="learned table rows; default s")
    add_bias_linear: bool = Field(True, strict=True, description="biases on QKV, projection, fc1 and fc2")
    add_qkv_bias: bool = Field(False, strict=True, description="a QKV bias even without add_bias_linear (Qwen2)")

    # The parallel layout beyond t (memcalc.pipeline, memcalc.totals).
    pp: int = Field(1, strict=True, gt=0, description="pipeline stages")
    vpp: Optional[int] = Field(None, strict=True, ge=2, description="interleaved model chunks per stage")
    dp: int = Field(1, strict=True, gt=0, description="data-parallel size")
    cp: int = Field(1, strict=True, gt=0, description="context-parallel size")
    distributed_optimizer: bool = Field(False, strict=True, description="shard optimizer states over dp*cp")

    @property
    def ffn(self) -> int:
        """The MLP's hidden size: 4h unless the config sets it."""
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.h

    @property
    def groups(self) -> int:
        """K/V head groups: a (plain multi-head) unless the config sets fewer."""
        return self.num_query_groups if self.num_query_groups is not None else self.a

    @property
    def positions(self) -> int:
        """Rows of a learned position table: max_position_embeddings, else s."""
        return self.max_position_embeddings if self.max_position_embeddings is not None else self.s


def build_config(fields: dict[str, Any]) -> ModelConfig:
    """Validate `fields` into a config, or raise ConfigError naming the field and rule."""
    config = _validate(ModelConfig, fields)
    check_divisibility(config)
    check_layout(config)
    return config


def build_knobs(fields: dict[str, Any]) -> ModelKnobs:
    """Validate knob fields alone, for commands that need no sizes."""
    return _validate(ModelKnobs, fields)


def _validate(model: type[ModelKnobs], fields: dict[str, Any]) -> Any:
    try:
        return model(**fields)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None
    except TypeError as exc:  # e.g. a YAML key that is not a string
        raise ConfigError(f"invalid config: {exc}") from None


def check_divisibility(config: ModelConfig) -> None:
    """The rules between fields that any strategy needs; each names its values."""
    c = config
    _divides(c.a, "a", c.h, "h", "each head gets h/a channels")
    _divides(c.t, "t", c.a, "a", "tensor parallelism gives each rank a/t heads")
    _divides(c.t, "t", c.ffn, "ffn_hidden_size", "the MLP is split into t column shards")
    _divides(c.groups, "num_query_groups", c.a, "a", "each K/V group serves a/num_query_groups heads")
    _divides(c.t, "t", c.groups, "num_query_groups", "each rank holds num_query_groups/t K/V groups")


def check_layout(config: ModelConfig) -> None:
    """The rules of pipeline and context parallelism, and of a learned position table."""
    c = config
    if c.vpp is not None and c.pp < 2:
        raise ConfigError(f"vpp={c.vpp} needs pp >= 2 (the interleaved schedule splits each stage into vpp chunks)")
    chunks, name = (c.pp * c.vpp, f"pp*vpp={c.pp}*{c.vpp}") if c.vpp is not None else (c.pp, "pp")
    _divides(chunks, name, c.L, "L", "every pipeline model chunk holds the same number of layers")
    if c.cp > 1:
        if c.attention != "flash":
            raise ConfigError(
                f"cp={c.cp} needs attention 'flash' (Megatron-LM runs context parallelism only in fused attention,"
                " which never keeps the s x s scores)"
            )
        _divides(2 * c.cp, "2*cp", c.s, "s", "each context-parallel rank takes one early and one late chunk of 2*cp")
    if c.position_embedding_type == "learned_absolute" and c.s > c.positions:
        raise ConfigError(
            f"s={c.s} exceeds max_position_embeddings={c.positions} (a learned table has one row per position)"
        )


def check_sequence_split(config: ModelConfig) -> None:
    """Sequence parallelism (and full recompute's sharded input) needs t | s, or t | s/cp with context parallelism."""
    if config.cp > 1:
        why = "sequence parallelism splits each context rank's tokens across t"
        _divides(config.t, "t", config.s // config.cp, "s/cp", why)
    else:
        _divides(config.t, "t", config.s, "s", "sequence parallelism splits the sequence across t ranks")


def _divides(divisor: int, dname: str, value: int, vname: str, why: str) -> None:
    if value % divisor:
        raise ConfigError(f"{vname}={value} is not divisible by {dname}={divisor} ({why})")


def load_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML mapping, turning every I/O or syntax problem into ConfigError."""
    import yaml  # only the --config path pays for it

    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}: YAML syntax error{at}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of fields, got {type(data).__name__}")
    return data


def load_config(path: Path | None, overrides: dict[str, Any], base: dict[str, Any] | None = None) -> ModelConfig:
    """A config from an optional YAML file (or `base`, fields already read from `path`) with flags laid over it."""
    fields = dict(base) if base is not None else load_yaml(path) if path is not None else {}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return build_config(fields)
    except ConfigError as exc:
        if path is None:
            raise
        raise ConfigError(f"{path}: {exc}") from None


def _describe(exc: ValidationError) -> str:
    """pydantic's first error as `field 'x': rule (got v)` on one line."""
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err["loc"]) or "config"
    if err["type"] == "extra_forbidden":
        return f"unknown field '{field}' (allowed: {', '.join(_field_names())})"
    if err["type"] == "missing":
        return f"field '{field}' is required"
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"field '{field}': {err['msg'].lower()} (got {err.get('input')!r}){more}"


def _field_names() -> list[str]:
    return list(ModelConfig.model_fields)
