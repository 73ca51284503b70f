"""The state and the shared ops of the hf step walk (`--impl hf`): what memcalc.sizing.timeline.hf's walk of
LlamaForCausalLM and hf_moe's walk of its sparse MoE blocks both run on: sizes, a linear's and an RMSNorm's backward,
a weight's gradient handed over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from memcalc.config.schema import ModelConfig
from memcalc.model.impls import hf as rules
from memcalc.sizing.timeline.fsdp import Fsdp
from memcalc.sizing.timeline.zero import Zero
from memcalc.sizing.timeline.tape import ACTIVATIONS, TEMPORARIES, Sizes, Tape

WHY_SAVED = "kept for backward (the hf ledger); freed when the op that keeps it has run backward"
WHY_WGRAD = "the weight's bf16 gradient, added into the fp32 buffer and dropped when autograd hands it over"

@dataclass
class HfWalk:
    """The walk: the tape, the sizes, the config and one layer's saved bytes by ledger name, and the ops that
    both the dense layers' walk (memcalc.sizing.timeline.hf) and the MoE blocks' (hf_moe) run."""

    tape: Tape
    z: Sizes
    config: ModelConfig
    saved: dict[str, int]
    in_backward: bool = False  # what is made from here on is a temporary, as MemTracker files it
    fsdp: Fsdp | Zero | None = None  # FSDP2's gathers and reduce-scatters around each block (dp_shard), or ZeRO's

    # -- sizes ------------------------------------------------------------------------------------

    def fp32(self, width: int) -> int:
        """Bytes of an fp32 (b, s, width) tensor."""
        return self.z.tokens(4 * width)

    def scores(self, width: int) -> int:
        """Bytes of a (b, a, s, s) tensor of `width`-byte elements."""
        z = self.z
        return width * z.b * z.a_t * z.s * z.s

    @property
    def kv(self) -> int:
        """K or V projection columns on this rank: g (under tp g/t) groups of d."""
        return self.z.g_t * self.z.d

    @property
    def q(self) -> int:
        """Query (and o_proj input) columns on this rank: a (under tp a/t) heads of d."""
        return self.z.a_t * self.z.d

    @property
    def tp(self) -> bool:
        """transformers' tp_plan lays the model over t > 1 ranks (DTensor: memcalc.probe.libs.hf_tp)."""
        return self.z.t > 1

    @property
    def logits(self) -> int:
        """Bytes of the bf16 logits, (b, s, v): lm_head's "colwise_gather_output" gathers every rank's columns."""
        z = self.z
        return z.act * z.b * z.s * self.config.vocab_size

    @property
    def eager(self) -> bool:
        return self.config.attention == "eager"

    @property
    def tied(self) -> bool:
        return self.config.tie_embeddings

    def add(self, name: str, nbytes: int, why: str) -> None:
        """A temporary (made in backward), or an activation while forward runs."""
        self.tape.add(name, TEMPORARIES if self.in_backward else ACTIVATIONS, nbytes, why)

    # -- ops both walks run ------------------------------------------------------------------------

    def linear_backward(
        self, where: str, grad: str | None, weight: int, dx: str, dx_bytes: int, kept: str | None,
        waits: str | None = None, reduced: bool = False,
    ) -> None:
        """nn.Linear's backward: dW = dY^T X, then dX = dY W, beside dY; then its kept input and dY go (dY stays
        where the residual stream still needs it: `grad` None), and dW is handed over unless it `waits`.

        `reduced`: a "colwise" linear under tp, whose dX is a Partial sum that the backward of DTensor.from_local
        all-reduces into a new tensor (the paper's f); the partial one goes when the next op runs (`drop_partial`).
        """
        partial = f"{dx} (partial)" if reduced else dx
        self.add(waits or f"grad/{where} weight", weight,
                 "the tied weight's gradient, waiting in autograd's input buffer" if waits else WHY_WGRAD)
        why = "dX = dY W, the input's gradient" + (", this rank's partial sum" if reduced else "")
        self.add(partial, dx_bytes, why)
        self.tape.mark("backward", where, "GEMMs: dW and dX")
        self.tape.drop(*(x for x in (grad, kept) if x))
        if not waits:
            self.hand_over(where, f"grad/{where} weight", weight)
        if reduced:
            self.add(dx, dx_bytes, "the input's gradient all-reduced over the ranks (DTensor: Partial -> Replicate)")
            self.tape.mark("backward", where, "dX all-reduced")

    def hand_over(self, where: str, name: str, nbytes: int) -> None:
        """A weight's gradient handed to autograd: added into the fp32 buffer and dropped, or under FSDP2 kept as
        the unsharded parameter's .grad until its block's reduce-scatter."""
        self.tape.drop(name)
        if self.fsdp is not None:
            self.fsdp.keep_grad(self.tape, self.fsdp.block_of(where), where, nbytes)

    def drop_partial(self, dx: str) -> None:
        """The partial sum a reduced dX was made from, freed when the next op runs (none without tp)."""
        self.tape.drop(f"{dx} (partial)")

    def rms_norm_backward(self, where: str, p: str, grad: str, out: str, residual: str | None = None) -> None:
        """LlamaRMSNorm's backward as autograd runs its eager ops: weight * y, y.to(bf16), x * r, rsqrt, mean, pow.

        Its widest moment is pow's backward: x's fp32 gradient through x * r, the mean's spread
        gradient and pow's three products, five fp32 (b, s, h) tensors. With a residual, the
        norm's dX and the residual stream's gradient are then summed.
        """
        z, tape, add = self.z, self.tape, self.add
        norm = norm_names(p)
        add(f"{where}/dY w", z.full(z.h), "weight * y's backward: dY * weight")
        add(f"{where}/dY y", z.full(z.h), "weight * y's backward: dY * y, then summed to the weight's shape")
        add(f"{where}/dweight", z.act * z.h, WHY_WGRAD)
        tape.drop(f"{where}/dY y")
        self.hand_over(where, f"{where}/dweight", z.act * z.h)
        tape.drop(grad, norm.normed)
        add(f"{where}/dy fp32", self.fp32(z.h), "y.to(bf16)'s backward: the gradient cast up to fp32")
        tape.drop(f"{where}/dY w")
        add(f"{where}/dx (x * r)", self.fp32(z.h), "x * r's backward: dy * r")
        add(f"{where}/dr full", self.fp32(z.h), "x * r's backward: dy * x, then summed over h")
        add(f"{where}/dr", z.tokens(4), "the rstd's gradient, (b, s, 1) fp32")
        tape.drop(f"{where}/dy fp32", f"{where}/dr full")
        for name in ("r^3", "-r^3 / 2"):
            add(f"{where}/{name}", z.tokens(4), "rsqrt's backward, (b, s, 1) fp32")
        add(f"{where}/dvariance", z.tokens(4), "rsqrt's backward: dr * -r^3 / 2")
        tape.drop(f"{where}/r^3", f"{where}/-r^3 / 2", f"{where}/dr", norm.rstd)
        add(f"{where}/dpow", self.fp32(z.h), "mean's backward: dvariance spread over h and divided by h")
        tape.drop(f"{where}/dvariance")
        add(f"{where}/x^1", self.fp32(z.h), "pow(2)'s backward: x^1")
        add(f"{where}/2x", self.fp32(z.h), "pow(2)'s backward: 2 * x^1")
        add(f"{where}/dx (pow)", self.fp32(z.h), "pow(2)'s backward: dpow * 2x")
        tape.mark("backward", where, "RMSNorm's backward at its widest: five fp32 (b, s, h) temporaries")
        tape.drop(f"{where}/x^1", f"{where}/2x", f"{where}/dpow", norm.input_fp32)
        add(f"{where}/dx fp32", self.fp32(z.h), "autograd sums x's two fp32 gradients (x * r and pow)")
        add(out if residual is None else f"{where}/dx", z.full(z.h), "x.to(float32)'s backward: cast back to bf16")
        tape.drop(f"{where}/dx (x * r)", f"{where}/dx (pow)")
        tape.drop(f"{where}/dx fp32")
        if residual is not None:
            add(out, z.full(z.h), "the residual stream's gradient: the norm's dX and the residual's summed")
            tape.drop(f"{where}/dx", residual)


class NormNames(NamedTuple):
    """Where one LlamaRMSNorm's kept tensors (memcalc.model.ledger.RMSNormTensors) live on the tape."""

    input_fp32: str
    rstd: str
    normed: str


def norm_names(prefix: str) -> NormNames:
    """An RMSNorm's three kept tensors' names under `prefix` ("layers.0/ln2", "final_norm"), as the ledger's."""
    return NormNames(*(f"{prefix}/{x.name.partition('/')[2]}" for x in rules.LN1_RMS))
