"""The paper: Korthikanti et al. 2022's accounting as an implementation of its own (shared/SEED.md).

The seed's layer exactly, at every size; its formulas, what it refuses and why: docs/impl-notes/paper.md, rendered
into docs/impl-paper.md.
"""

from __future__ import annotations

from typing import Any

from memcalc.errors import ConfigError
from memcalc.model import ledger
from memcalc.model.impls.base import Implementation, drop_small
from memcalc.model.knobs import KNOBS, Accounting, Impl, Knobs
from memcalc.model.ledger import SavedTensor
from memcalc.model.tp_plan import ATTENTION, MLP, Rule, Style, TPPlan, pair

# The knobs whose values the paper models; every other knob must keep its default, the seed's layer.
MODELLED = ("impl", "family", "dropout", "recompute", "dtype")  # family: a name, whose layer the others describe
SEED_LAYER = ("the seed's layer (LayerNorm, GELU MLP of 4h, multi-head eager attention, 16-bit activations,"
              " dropout, no experts or latents)")


def keeps(knobs: Any, accounting: Accounting) -> tuple[SavedTensor, ...]:
    """The seed's per-layer ledger (SEED.md section 2), in forward order; LayerNorm statistics with exact accounting
    (unless fully recomputed)."""
    core = () if knobs.recompute == "selective" else (
        ledger.SOFTMAX_OUT, ledger.ATTN_DROPOUT_MASK, ledger.ATTN_DROPOUT_OUT,
    )
    return drop_small((
        *ledger.LN1, ledger.QKV_IN, ledger.Q, ledger.K, ledger.V, *core, ledger.PROJ_IN, ledger.ATTN_OUT_DROPOUT_MASK,
        *ledger.LN2, ledger.FC1_IN, ledger.GELU_IN, ledger.FC2_IN, ledger.MLP_DROPOUT_MASK,
    ), accounting)


def outside(knobs: Any) -> str | None:
    """The first knob (or config field) that takes the layer outside the seed's, in words; None inside it."""
    seed = Knobs.of(knobs)  # K/V groups equal to the heads, heads of h/a channels: as unset
    h = getattr(knobs, "h", None)
    for knob in KNOBS:
        value = getattr(seed, knob.name)
        if knob.name in MODELLED or Impl.PAPER in knob.impls or value == knob.default:  # its own: Megatron's split
            continue
        if knob.name == "ffn_hidden_size" and (h is None or value == 4 * h):  # a knob set alone has no h: its
            continue  # config was checked, and a formula writes the width f (the seed's 4h when f = 4h)
        return f"{knob.name}={value}"
    if knobs.dropout == 0:
        return "dropout=0.0 (the paper's layer keeps its dropout masks; any p > 0 keeps the same bytes)"
    if knobs.dtype == "fp32":
        return "dtype=fp32 (the paper counts 16-bit activations)"
    if knobs.recompute not in ("none", "selective", "full"):
        return f"recompute={knobs.recompute} (the paper has none, selective and full)"
    if getattr(knobs, "cp", 1) != 1:
        return f"cp={knobs.cp} (context parallelism is not the paper's sequence parallelism, SEED.md section 6)"
    return None


def check(knobs: Any) -> None:
    """ConfigError naming the first knob outside the seed's layer."""
    knob = outside(knobs)
    if knob is not None:
        raise ConfigError(f"impl paper models {SEED_LAYER}; {knob} is outside it: use --impl megatron, hf or"
                          " torchtitan")


# memcalc's own layer (memcalc/probe/layer.py), Megatron's split: the seed's f, f*, g and g* around each pair.
TP_PLAN = TPPlan((Rule("ln1", Style.SEQUENCE), *pair(ATTENTION, ("attention.qkv",), "attention.proj"),
                  Rule("ln2", Style.SEQUENCE), *pair(MLP, ("mlp.fc1",), "mlp.fc2")))

IMPLEMENTATION = Implementation(
    name="paper",
    title="the paper (Korthikanti et al. 2022)",
    measured_on="memcalc's own layer with a fused scale-mask-softmax that keeps its 16-bit output"
    " (memcalc measure --impl paper)",
    keeps=keeps,
    tp_plan=lambda knobs: TP_PLAN,
    check=check,
)
