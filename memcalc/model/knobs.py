"""The knobs: every choice that changes what a layer saves, declared once in `KNOBS`.

A knob is a vocabulary word: its name, its choices (an enum), its default, its
help, the symbol a formula writes for it, the words that describe it, and what
each non-default value changes. Everything else is generated from this table:
the `Knobs` dataclass (and so the config schema, which extends it), the CLI
flags, the sweep's CSV columns, the one-line description of a model, and the
variants in docs/model.md. `tests/model/test_knobs.py` checks that every
consumer covers every knob.

Choice values are `str` enums, so `knobs.mlp == "swiglu"` reads naturally and
JSON writes them as their text.
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from enum import Enum
from typing import Any, Callable

from memcalc.model.ledger import Kind


class Choice(str, Enum):
    """A knob's value: compares equal to, prints as, and serialises as its text."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __hash__(self) -> int:  # as its text, so a member and its string are one dict key
        return str.__hash__(self)


class Impl(Choice):
    MEGATRON = "megatron"
    TORCHTITAN = "torchtitan"
    HF = "hf"


class Mlp(Choice):
    GELU = "gelu"
    SWIGLU = "swiglu"
    GELU_TANH = "gelu_tanh"  # tanh-approximated GELU: HF gelu_new, gelu_pytorch_tanh, gelu_fast; Megatron bias_gelu


class Attention(Choice):
    EAGER = "eager"
    FLASH = "flash"


class Norm(Choice):
    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"


class Recompute(Choice):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"
    OP = "op"  # torchtitan's op-level selective checkpointing: keeps chosen ops' outputs, reruns the rest


class Dtype(Choice):
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"


DTYPE_BYTES = {Dtype.BF16: 2, Dtype.FP16: 2, Dtype.FP32: 4}


@dataclass(frozen=True)
class Knob:
    """One knob: what it is called, what it may be, and how it reads everywhere.

    `kind` is "choice" (one of `choices`), "size" (a positive integer, or None for
    the default that depends on other sizes), "probability" (0 <= p < 1) or
    "flag" (a boolean). `describe` gives the words of the model's one-line
    description from a config or knob set (None: another knob's words carry it).
    """

    name: str
    kind: str
    default: Any
    help: str
    describe: Callable[[Any], str | None]
    choices: type[Choice] | None = None
    symbol: str | None = None  # the formula symbol for a set value (f, g)
    # (a non-default value, or a mapping of knob values to set together, and what it changes), for docs/model.md
    effects: tuple[tuple[Any, str], ...] = ()

    def variants(self) -> tuple[tuple[dict[str, Any], str], ...]:
        """Each effect as the knob values it sets and what it changes."""
        return tuple((v if isinstance(v, dict) else {self.name: v}, meaning) for v, meaning in self.effects)

    @property
    def flag(self) -> str:
        """The command-line flag: --num-query-groups for num_query_groups."""
        return "--" + self.name.replace("_", "-")

    @property
    def values(self) -> tuple[str, ...]:
        """A choice knob's values, default first."""
        assert self.choices is not None, self.name
        return (self.default.value, *(c.value for c in self.choices if c is not self.default))


def _ffn(k: Any) -> str:
    return str(getattr(k, "ffn", None) or k.ffn_hidden_size or "4h")


def _groups(k: Any) -> str:
    return str(getattr(k, "groups", None) or k.num_query_groups or "a")


KNOBS: tuple[Knob, ...] = (
    Knob(
        "impl", "choice", Impl.MEGATRON,
        "whose code runs the layer: megatron (Megatron-core), torchtitan, hf (Hugging Face transformers)",
        lambda k: None if k.impl == Impl.MEGATRON else f"impl {k.impl}", Impl,
    ),
    Knob(
        "mlp", "choice", Mlp.GELU, "MLP activation (gelu_tanh: GELU's tanh approximation)",
        lambda k: f"{k.mlp} (ffn {_ffn(k)})", Mlp,
        effects=(({"mlp": Mlp.SWIGLU, "ffn_hidden_size": 1}, "SwiGLU computes SiLU(gate) * up: backward needs the gate (for SiLU's derivative)"
                  " and both factors of the product, three (b, s, f) tensors where GELU kept one."),),
    ),
    Knob(
        "ffn_hidden_size", "size", None, "MLP hidden size (default 4h)", lambda k: None, symbol="f",
        effects=((1, "An MLP width f other than 4h changes only the two tensors of that width."),),
    ),
    Knob(
        "attention", "choice", Attention.EAGER, "core attention: eager (op by op) or flash (a fused kernel)",
        lambda k: f"{k.attention} attention ({_groups(k)} K/V groups)", Attention,
        effects=((Attention.FLASH, "A fused kernel never materialises the s x s scores: backward rebuilds them"
                  " from Q, K and V, and regenerates the dropout mask from the RNG seed."),),
    ),
    Knob(
        "num_query_groups", "size", None, "K/V groups (default a, multi-head)", lambda k: None, symbol="g",
        effects=((1, "Grouped-query attention keeps K and V for g groups of heads instead of a."),),
    ),
    Knob(
        "norm", "choice", Norm.LAYERNORM, "normalisation", lambda k: f"{k.norm}", Norm,
        effects=((Norm.RMSNORM, "RMSNorm subtracts no mean; under the paper's accounting nothing changes"
                  " (see the exact variant)."),),
    ),
    Knob(
        "dropout", "probability", 0.1, "dropout probability; 0 saves no masks", lambda k: f"dropout {k.dropout}",
        effects=((0.0, "Without dropout there are no masks, and the weights x V matmul reads the softmax output"
                  " itself."),),
    ),
    Knob(
        "recompute", "choice", Recompute.NONE, "activation recomputation", lambda k: f"recompute {k.recompute}",
        Recompute,
        effects=(
            (Recompute.SELECTIVE, "Selective recomputation (Korthikanti et al. 2022) reruns the attention core in"
             " backward, so none of its s x s tensors is kept."),
            (Recompute.FULL, "Full recomputation keeps only the layer's input and reruns the whole forward in"
             " backward."),
        ),
    ),
    Knob(
        "dtype", "choice", Dtype.BF16, "activation dtype", lambda k: f"{k.dtype}", Dtype,
        effects=((Dtype.FP32, "Activations take the wider dtype; dropout masks stay one byte."),),
    ),
    Knob(
        "bias_activation_fusion", "flag", False,
        "megatron: fused bias + activation kernel (bias_activation_fusion; keeps the fc1 output only)",
        lambda k: "fused bias-activation" if k.bias_activation_fusion else None,
        effects=(({"mlp": Mlp.SWIGLU, "ffn_hidden_size": 1, "bias_activation_fusion": True},
                  "Megatron's fused bias-SwiGLU (BiasSwiGLUFunction) keeps only fc1's 2f-wide output; unfused, the"
                  " layer also keeps SiLU's output and a copy of up."),),
    ),
)
BY_NAME: dict[str, Knob] = {k.name: k for k in KNOBS}


def _knobs_namespace() -> dict[str, Any]:
    """The properties every knob set (and so every config) has, beside its fields."""

    def of(cls: type, config: Any) -> Any:
        """The knobs of a config (or another knob set), alone: a small, hashable key.

        K/V groups equal to the heads are multi-head attention, as if unset.
        """
        values = {k.name: getattr(config, k.name) for k in KNOBS}
        if values["num_query_groups"] == getattr(config, "a", None):
            values["num_query_groups"] = None
        return Knobs(**values)

    return {
        "__doc__": "The choices that decide which tensors a layer saves; defaults are the seed's model (KNOBS).",
        "of": classmethod(of),
        "has_dropout": property(lambda self: self.dropout > 0, doc="any dropout at all: masks are kept only when p > 0"),
        "ffn_set": property(lambda self: self.ffn_hidden_size is not None, doc="formulas write f, not 4h"),
        "gqa": property(lambda self: self.num_query_groups is not None, doc="formulas write g, not a"),
    }


def knob_field(knob: Knob) -> Any:
    """A dataclass field for a knob; its metadata carries the knob, for the config schema."""
    return field(default=knob.default, metadata={"knob": knob, "help": knob.help})


_TYPES = {"choice": str, "size": "int | None", "probability": float, "flag": bool}

Knobs = make_dataclass(
    "Knobs",
    [(k.name, k.choices or _TYPES[k.kind], knob_field(k)) for k in KNOBS],
    frozen=True, kw_only=True, namespace=_knobs_namespace(),
)
Knobs.__module__ = __name__  # for pickling across the probe's processes


@dataclass(frozen=True)
class Accounting:
    """How strictly to count: the paper's terms only, or every saved byte.

    `device` matters only for exact accounting: LayerNorm statistics are fp32
    on CUDA but kept in the activation dtype on CPU, and an implementation may
    keep other tensors where a CPU kernel is not its CUDA twin.
    """

    exact: bool = False
    device: str = "cuda"


def element_bytes(kind: Kind, knobs: Any, accounting: Accounting) -> int:
    """Bytes per element of a tensor of this kind."""
    if kind is Kind.MASK:
        return 1
    if kind is Kind.INT64:
        return 8
    if kind is Kind.FP32 or (kind is Kind.NORM_STATS and accounting.device == "cuda"):
        return 4
    return DTYPE_BYTES[knobs.dtype]
