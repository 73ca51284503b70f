"""The rules between a config's fields and between its knobs, declared once, below both the config and the model.

`memcalc.config.schema` checks them on a config, the implementations (`memcalc.model.impls`) on a knob set,
and sweeps (`memcalc.sizing.sweep`) apply the same tables per point, vectorised.
"""

from __future__ import annotations

from typing import Any

from memcalc.errors import ConfigError
from memcalc.model.knobs import BY_NAME as KNOB_NAMES, KNOBS, MLA_KNOBS, is_moe
from memcalc.records import record


@record
class Rule:
    """`divisor` must divide `value` (both field names), and why."""

    divisor: str
    value: str
    why: str
    unless: str | None = None  # a knob whose setting lifts the rule (heads of kv_channels need not split h)

    def applies(self, knobs: Any) -> bool:
        return self.unless is None or getattr(knobs, self.unless) is None

    def message(self, divisor: int, value: int) -> str:
        return not_divisible(divisor, self.divisor, value, self.value, self.why)

    @property
    def text(self) -> str:
        return f"{self.divisor} must divide {self.value}"

    @property
    def operands(self) -> tuple[str, str]:
        """The two fields the rule compares, in the order `fails` and `message` take their values."""
        return self.divisor, self.value

    def fails(self, divisor: Any, value: Any) -> Any:
        """Whether the rule breaks, on numbers or numpy arrays alike."""
        return value % divisor != 0

    def check(self, config: Any) -> None:
        """Raise ConfigError if the rule fails, reading each size as used (4h and a when unset)."""
        if not self.applies(config):
            return
        operands = [getattr(config, AS_USED.get(n, n)) for n in self.operands]
        if self.fails(*operands):
            raise ConfigError(self.message(*operands))


@record
class Limit(Rule):
    """`value` may not exceed `divisor` (here a bound, not a divisor), and why: a rule sweeps apply per point."""

    def fails(self, bound: Any, value: Any) -> Any:
        return value > bound

    def message(self, bound: int, value: int) -> str:
        return f"{self.value}={value} exceeds {self.divisor}={bound} ({self.why})"

    @property
    def text(self) -> str:
        return f"{self.value} may not exceed {self.divisor}"


@record
class SoftmaxOfOne(Rule):
    """`value` (the top-k) may not be 1 where megatron's router takes the softmax of the k chosen logits, and why
    (`divisor` is not read): megatron-core's TransformerConfig refuses it."""

    def applies(self, knobs: Any) -> bool:
        return (knobs.impl == "megatron" and knobs.moe_router_score_function == "softmax"
                and not knobs.moe_router_pre_softmax)

    def fails(self, _: Any, value: Any) -> Any:
        return value == 1

    def message(self, _: int, value: int) -> str:
        return f"{self.value}={value} needs moe_router_pre_softmax under impl megatron ({self.why})"

    @property
    def text(self) -> str:
        return f"{self.value} may not be 1 under impl megatron's softmax router without moe_router_pre_softmax"


@record
class SparseStep(Rule):
    """`divisor` (moe_layer_freq: config.json's decoder_sparse_step) must divide `value` (L) in Qwen2-MoE's and
    Qwen3-MoE's layers run by an implementation that places a MoE layer where freq divides i, not i + 1 as
    transformers does (ModelConfig.is_moe_layer): only then is the count of MoE layers the same."""

    def applies(self, knobs: Any) -> bool:
        return knobs.family in ("qwen2_moe", "qwen3_moe") and knobs.impl != "hf" and knobs.moe


@record
class ChunkedLoss(Rule):
    """`divisor` (loss_chunks, a knob) must divide `value` (s) where torchtitan's ChunkedLossWrapper splits the
    sequence (impl torchtitan, loss_chunks > 0): its torch._check refuses unequal chunks."""

    def applies(self, knobs: Any) -> bool:
        return knobs.impl == "torchtitan" and knobs.loss_chunk_count > 0

    @property
    def operands(self) -> tuple[str, str]:
        """The count as used (8 when loss_chunks is unset), and s."""
        return "loss_chunk_count", self.value

    def message(self, divisor: int, value: int) -> str:
        plain = "use loss_chunks 0 (its plain CrossEntropyLoss) or a count dividing s"
        return f"{super().message(divisor, value)}; {plain}"


# Fields whose value as used can come from a default that depends on others (4h, a).
AS_USED = {"ffn_hidden_size": "ffn", "num_query_groups": "groups"}

# The rules between sizes that every strategy needs (sweeps apply the same table, vectorised).
DIVISIBILITY = (
    Rule("a", "h", "each head gets h/a channels unless kv_channels is set", unless="kv_channels"),
    Rule("t", "a", "tensor parallelism gives each rank a/t heads"),
    Rule("t", "ffn_hidden_size", "the MLP is split into t column shards"),
    Rule("num_query_groups", "a", "each K/V group serves a/num_query_groups heads"),
    Rule("t", "num_query_groups", "each rank holds num_query_groups/t K/V groups"),
    SparseStep("moe_layer_freq", "L", "Qwen's layer i is sparse when decoder_sparse_step divides i + 1, impl"
               " megatron's and torchtitan's when moe_layer_freq divides i: as many MoE layers only then; impl hf"
               " places them as transformers does"),
)
SEQUENCE_SPLIT = Rule("t", "s", "sequence parallelism splits the sequence across t ranks")
# torchtitan's loss, which a layer does not see: the step walk checks it (memcalc.sizing.timeline.torchtitan)
CHUNKED_LOSS = ChunkedLoss("loss_chunks", "s", "torchtitan's ChunkedLossWrapper splits each rank's sequence into"
                           " loss_chunks equal chunks")
# The rules between a mixture of experts' sizes (sweeps apply them per point when they sweep E, k or ep).
EXPERT_RULES = (
    Rule("ep", "num_experts", "each expert-parallel rank holds num_experts/ep experts"),
    Limit("num_experts", "moe_router_topk", "each token picks k distinct experts"),
    SoftmaxOfOne("num_experts", "moe_router_topk", "a softmax over one logit has no gradient"),
)

# The knobs each check reads, chosen once: `estimate` checks every config it is given, and sweeps call it in loops.
_MOE_KNOBS = tuple(k for k in KNOBS if is_moe(k))
_IMPL_KNOBS = tuple(k for k in KNOBS if k.impls)


def check_moe(knobs: Any) -> None:
    """ConfigError for MoE knobs that say nothing without experts, or ask for what cannot be."""
    if knobs.num_experts is None:
        stray = [k.name for k in _MOE_KNOBS if getattr(knobs, k.name) != k.default]
        if stray:
            raise ConfigError(f"{stray[0]} is set but num_experts is not (a dense MLP has no experts)")
        return
    for rule in EXPERT_RULES[1:]:  # k distinct experts of E; megatron's softmax over more than one
        rule.check(knobs)
    if knobs.moe_tokens == "capacity" and knobs.moe_expert_capacity_factor is None:
        raise ConfigError("moe_tokens capacity needs moe_expert_capacity_factor (without it no expert drops tokens:"
                          " use balanced or worst)")
    if knobs.moe_pad_expert_input_to_capacity and knobs.moe_expert_capacity_factor is None:
        raise ConfigError("moe_pad_expert_input_to_capacity pads each expert's tokens to its capacity: it needs"
                          " moe_expert_capacity_factor")
    default = KNOB_NAMES["experts_implementation"].default
    if knobs.impl != "hf" and knobs.experts_implementation != default:
        raise ConfigError(f"experts_implementation {knobs.experts_implementation} is transformers' choice (--impl hf);"
                          f" impl {knobs.impl} runs its own experts (leave it {default})")
    if knobs.moe_router_enable_expert_bias and knobs.moe_router_score_function != "sigmoid":
        raise ConfigError("moe_router_enable_expert_bias biases the sigmoid router's choice (aux-loss-free balancing):"
                          " it needs moe_router_score_function sigmoid")


def check_settings(knobs: Any) -> None:
    """ConfigError for a knob that only some implementations have (`Knob.impls`), set away from its default under
    another: the library asked for has no such setting, so the value would change nothing."""
    for knob in _IMPL_KNOBS:
        value = getattr(knobs, knob.name)
        if knobs.impl not in knob.impls and value != knob.default:
            leave = "leave it unset" if knob.default is None else f"leave it at {knob.default}"
            raise ConfigError(f"{knob.name}={value} is a setting of impl {', '.join(knob.impls)} only; impl {knobs.impl}"
                              f" has none ({leave})")


def check_mla(knobs: Any) -> None:
    """ConfigError for latent-attention widths without kv_lora_rank, a latent without its head widths, GQA, or plain
    attention's head width and QK norm."""
    if knobs.kv_lora_rank is None:
        stray = [name for name in MLA_KNOBS if getattr(knobs, name) is not None]
        if stray:
            raise ConfigError(f"{stray[0]} is set but kv_lora_rank is not (only latent attention has it)")
        return
    missing = [name for name in MLA_KNOBS[2:] if getattr(knobs, name) is None]
    if missing:
        raise ConfigError(f"kv_lora_rank={knobs.kv_lora_rank} needs {', '.join(missing)} (latent attention's head"
                          " widths)")
    if knobs.num_query_groups not in (None, getattr(knobs, "a", None)):  # a config's groups may equal its heads
        raise ConfigError(f"num_query_groups={knobs.num_query_groups} with kv_lora_rank: latent attention up-projects"
                          " K and V for every head (no K/V groups); leave num_query_groups unset")
    if knobs.head_dim_set or knobs.qk_layernorm:
        raise ConfigError(f"{'kv_channels' if knobs.head_dim_set else 'qk_layernorm'} with kv_lora_rank: latent"
                          " attention sizes its heads by qk_nope_head_dim, qk_rope_head_dim and v_head_dim, and its"
                          " norms are on the latents, always; leave it unset")


def not_divisible(divisor: int, dname: str, value: int, vname: str, why: str) -> str:
    """The one wording of a broken divisibility rule: the equation with its values, then why."""
    return f"{vname}={value} is not divisible by {dname}={divisor} ({why})"


def divides(divisor: int, dname: str, value: int, vname: str, why: str) -> None:
    """ConfigError, in `not_divisible`'s words, unless `divisor` divides `value`."""
    if value % divisor:
        raise ConfigError(not_divisible(divisor, dname, value, vname, why))


def check_sequence_split(config: Any) -> None:
    """Sequence parallelism (and full recompute's sharded input) needs t | s, or t | s/cp with context parallelism."""
    if config.cp > 1:
        why = "sequence parallelism splits each context rank's tokens across t"
        divides(config.t, "t", config.s // config.cp, "s/cp", why)
    else:
        SEQUENCE_SPLIT.check(config)
