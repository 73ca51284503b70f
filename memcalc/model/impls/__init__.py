"""The implementation axis: one module per library, each listing what its layer keeps.

`IMPLEMENTATIONS` is the registry (`--impl` and `impl:` choose from it);
`layer_tensors` asks the chosen implementation, after checking that it runs
the knobs asked for. See `base.Implementation` for what an implementation says.
An implementation's module is imported the first time it is asked for:
`memcalc estimate` runs in loops and pays only for the one it uses.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any

from memcalc.errors import ConfigError
from memcalc.model.impls.base import Implementation, SizeRule, always
from memcalc.model.knobs import Accounting
from memcalc.model.ledger import SavedTensor
from memcalc.model.rules import check_mla, check_moe, check_settings
from memcalc.model.strategy import STRATEGIES, Strategy

_MODULES = ("megatron", "hf", "torchtitan", "paper")  # memcalc.model.impls.<name>, each with its IMPLEMENTATION


class _Registry(Mapping[str, Implementation]):
    """name -> Implementation, each module imported on first use."""

    def __getitem__(self, name: str) -> Implementation:
        if name not in _MODULES:
            raise KeyError(name)
        return importlib.import_module(f"{__name__}.{name}").IMPLEMENTATION

    def __iter__(self) -> Iterator[str]:
        return iter(_MODULES)

    def __len__(self) -> int:
        return len(_MODULES)


IMPLEMENTATIONS: Mapping[str, Implementation] = _Registry()


def implementation(knobs: Any) -> Implementation:
    """The implementation a knob set (or config) names, after it has checked the knobs."""
    impl = IMPLEMENTATIONS[knobs.impl]  # a knob set's impl is one of the `impl` knob's choices, each a module here
    check_settings(knobs)
    check_moe(knobs)
    check_mla(knobs)
    if knobs.family is not None:  # the families' table is imported only where a config names one (or impl hf)
        from memcalc.model.families import check_name

        check_name(knobs)
    _check_hf_only(knobs)
    impl.check(knobs)
    return impl


# Knobs of a layer only transformers' code is measured for, and the layer that has each.
_HF_ONLY = {"parallel_residual": "GPTNeoXLayer", "rotary_percent": "GPTNeoXLayer or Starcoder2DecoderLayer",
            "sandwich_norm": "Gemma2DecoderLayer",
            "attn_logit_softcapping": "Gemma2DecoderLayer", "final_logit_softcapping": "Gemma2ForCausalLM",
            "fused_qkv": "Phi3DecoderLayer",
            "post_norm": "Olmo2DecoderLayer", "alibi": "BloomBlock", "single_norm": "GPTJBlock or CohereDecoderLayer",
            "attention_sinks": "GptOssDecoderLayer"}
# Choices only transformers' layers are measured with (Gemma's GemmaRMSNorm and GeGLU, OLMo's, OLMo 2's and Cohere's
# norms, gpt-oss's clamped GLU).
_HF_ONLY_CHOICES = {"norm": ("rmsnorm_1p", "layernorm_np", "rmsnorm_fp32w", "layernorm_nb"),
                    "mlp": ("geglu_tanh", "swiglu_clamped")}


def _check_hf_only(knobs: Any) -> None:
    """GPT-NeoX's, Gemma's, OLMo's and Phi-3's layers are counted under --impl hf only: Megatron's and torchtitan's
    layers have no parallel residual, rotate whole heads, have neither Gemma's (1 + w) RMSNorm and tanh GeGLU nor
    OLMo's weightless fp32 LayerNorm, and keep no views of a fused qkv_proj output."""
    if knobs.impl == "hf":
        return
    given = [name for name in _HF_ONLY if getattr(knobs, name) not in (None, False)]
    if given:
        from memcalc.model.families import FAMILIES  # only to word the refusal: the family's layer, if one is named

        named = FAMILIES[knobs.family].layer if knobs.family else None
        layers = named or " or ".join(dict.fromkeys(_HF_ONLY[name] for name in given))
        names = ", ".join(given[:-1]) + " and " * (len(given) > 1) + given[-1]
        verb = "is" if len(given) == 1 else "are"
        raise ConfigError(f"{names} (of transformers' {layers}) {verb} modelled under --impl hf only; impl"
                          f" {knobs.impl}'s layer has no such choice")
    for name, values in _HF_ONLY_CHOICES.items():
        if getattr(knobs, name) in values:
            raise ConfigError(f"{name} {getattr(knobs, name)} (a transformers family's) is modelled under --impl hf"
                              f" only; impl {knobs.impl}'s layer has no such choice")


def plan(knobs: Any, strategy: Strategy) -> Strategy:
    """`strategy` as the chosen implementation lays it out, or ConfigError if the library does not run it
    (at all, or for these knobs: its declared `refuses`, whose reason the one line carries)."""
    impl = implementation(knobs)
    refusal = impl.refusal(knobs, strategy.name)
    if refusal is not None:
        raise ConfigError(
            f"impl {impl.name} ({impl.title}) does not run {strategy.name} ({strategy.title}) {refusal.cited()};"
            f" it runs: {', '.join(impl.runs(knobs))}"
        )
    return strategy.planned(impl, knobs)


def strategies_of(knobs: Any) -> tuple[str, ...]:
    """The layouts the chosen implementation runs for these knobs, in the order of STRATEGIES."""
    return implementation(knobs).runs(knobs)


def left_out(knobs: Any) -> tuple[str, ...]:
    """One line for each layout the implementation runs for other knobs but not these, saying why: what a
    command that shows every layout prints beside the ones it shows (a layout it never runs goes unsaid)."""
    impl = implementation(knobs)
    refused = (impl.refusal(knobs, n) for n in STRATEGIES)
    return tuple(f"{r.strategy} left out: impl {impl.name} does not run it {r.condition}: {r.reason}"
                 for r in refused if r is not None and r.when is not always)


def layer_tensors(knobs: Any, accounting: Accounting) -> tuple[SavedTensor, ...]:
    """Every tensor one layer keeps for backward, in forward order, as the chosen implementation keeps it
    (where its kernels run: see `tensors_at` for the sizes at which one does not)."""
    return implementation(knobs).layer_tensors(knobs, accounting)


def size_rule(knobs: Any) -> SizeRule | None:
    """The implementation's size rule, if the knobs make the sizes matter."""
    rule = implementation(knobs).size_rule
    return rule if rule is not None and rule.applies(knobs) else None


def tensors_at(knobs: Any, accounting: Accounting, sizes: dict[Any, Any], t: int) -> tuple[SavedTensor, ...]:
    """What one layer keeps at these sizes (t: the layout's split): `layer_tensors`, or the size rule's other set,
    each size condition's tensor replaced (or dropped) where the sizes take the other branch."""
    rule = size_rule(knobs)
    kept = rule.outside(knobs, accounting) if rule is not None and not rule.runs_at(knobs, sizes, t) else \
        layer_tensors(knobs, accounting)
    changed = {c.tensor.name: c.instead for c in implementation(knobs).size_conditions
               if c.applies(knobs) and not c.kept(sizes, t)}
    return tuple(z for x in kept for y in changed.get(x.name, (x,)) for z in _placed(y, x, changed))


def _placed(y: SavedTensor, x: SavedTensor, changed: dict[str, tuple[SavedTensor, ...]]) -> tuple[SavedTensor, ...]:
    """`y`, kept in `x`'s place (or as `x`): where it is another tensor, only where its own condition keeps it, else
    its `instead` (torchtitan's SelectiveAC, whose shifted count saves the next matmul's output only where it is
    counted first)."""
    return changed.get(y.name, (y,)) if y.name != x.name else (y,)
