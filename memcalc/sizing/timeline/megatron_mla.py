"""Megatron's latent attention (megatron-core 0.16's MLASelfAttention, DeepSeek-V2/V3) in the step, as ops.

Its backward op by op, and what megatron keeps beside the ledger: docs/timeline.md, "Megatron's latent attention".
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from memcalc.config.schema import ModelConfig
from memcalc.errors import ConfigError
from memcalc.model import ledger
from memcalc.model.impls import megatron
from memcalc.model.knobs import Accounting
from memcalc.model.ledger import Kind, Region, SavedTensor
from memcalc.sizing.timeline.megatron_pieces import (
    GLOBAL_MEMORY_BUFFER, Has, backward_only, fused_softmax, linear, masks_in_place, norm_kernel, one, row_parallel,
    softmax,
)
from memcalc.sizing.timeline.tape import ACTIVATIONS, Sizes, Tape
from memcalc.sizing.timeline.walk import Made, Op, Step

# ScaledUpperTriangMaskedSoftmax.forward: `scale_t = torch.tensor([scale])`, saved for its backward.
SOFTMAX_SCALE = SavedTensor(
    "attention/softmax_scale", "megatron's fused causal softmax: torch.tensor([scale])", (), Kind.FP32,
    Region.REPLICATED, "the kernel's backward scales by it; host memory on CUDA (not the GPU's), the CPU's here",
    paper=False,
)


# Attention._checkpointed_attention_forward (selective recomputation): `torch.tensor([attn_mask_type.value])`, an
# input of megatron's CheckpointFunction, which keeps its inputs.
ATTN_MASK_TYPE = SavedTensor(
    "attention/attn_mask_type", "megatron's core-attention checkpoint: torch.tensor([attn_mask_type.value])", (),
    Kind.INT32, Region.REPLICATED, "the checkpoint keeps its inputs for the rerun; host memory on CUDA, the CPU's"
    " here", paper=False,
)

# DotProductAttention and its modules, where their backward runs
CORE = "attention.core_attention"
CORE_DROPOUT = f"{CORE}.attention_dropout"
CORE_SOFTMAX = f"{CORE}.scale_mask_softmax"


@dataclass(frozen=True)
class Widths:
    """The latent attention's widths (per head, or of a latent)."""

    nope: int  # d_n
    rope: int  # d_r
    v: int  # d_v
    q_latent: int | None  # r_q (None: q_proj reads x)
    kv_latent: int  # r_kv

    @classmethod
    def of(cls, config: ModelConfig) -> Widths:
        return cls(config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, config.q_lora_rank,
                   config.kv_lora_rank)

    @property
    def qk(self) -> int:
        return self.nope + self.rope


def attention(ops: list[Op], config: ModelConfig, z: Sizes, grad: str, residual: str, has: Has) -> str:
    """The attention's backward, from the gradient of its output `grad` (the residual stream's, `residual`, or its
    dropout's) to its input's, appended to `ops` in backward order. Returns the input gradient's name."""
    if config.attention == "flash":
        raise ConfigError("the step timeline does not model latent attention with flash attention yet: megatron's"
                          " flash core is Transformer Engine's (CUDA only, not measured); it walks the local"
                          " DotProductAttention (--attention eager)")
    w = Widths.of(config)
    ops.append(row_parallel(z, "attention.linear_proj", ledger.MLA_PROJ_IN, grad, residual, z.a_t * w.v,
                             "grad/proj input"))
    inside: list[Op] = []
    _core(inside, config, z, w, "grad/proj input", has)
    _rope(inside, "key", z.full(w.rope), expanded=True)
    _rope(inside, "query", z.full(z.a_t * w.rope), expanded=False)
    _splits(inside, z, w)
    ops.extend(_left_open(inside, config, z, has))
    _up(ops, z, w)
    return _down(ops, z, w)


def _left_open(ops: list[Op], config: ModelConfig, z: Sizes, has: Has) -> list[Op]:
    """`ops` (the core's backward to the splits') as MemTracker reads them. ModTracker enters a module in backward as
    its output's gradient arrives and leaves it as its inputs' arrive; it never leaves one whose input is its output
    (nn.Dropout at p = 0 returns its input: the leave runs first, then the enter) nor one whose input was masked in
    place (scale_mask_softmax's, `masks_in_place`: the hook waits on a node autograd no longer runs). From the
    softmax's backward on MemTracker then reads every op inside that module (the last entered with no active
    submodule) but those of modules entered after it: the up projections'. Under selective recomputation the core
    runs without grad, then in backward, where ModTracker hooks no backward."""
    dropout = has(ledger.ATTN_DROPOUT_MASK.name)
    open_ = CORE_DROPOUT if not dropout else CORE_SOFTMAX if masks_in_place(config, z, has) else ""
    if config.recompute == "selective" or not open_:
        return ops
    i = next(i for i, op in enumerate(ops) if op.where == CORE_SOFTMAX)
    return [*ops[:i], *(replace(op, shadow=open_) for op in ops[i:])]


def _splits(ops: list[Op], z: Sizes, w: Widths) -> None:
    """The core's dK, dV and dQ with the RoPE parts' input gradients, concatenated as the up projections' outputs
    were split."""
    ops.append(one("attention", "d[k_nope | v] concatenated: kv_up_proj's output gradient", Made(
        "grad/kv up output", z.full(z.a_t * (w.nope + w.v)), "k_nope and v were split from kv_up_proj's"
        " output: their gradients concatenated"), ("grad/k", "grad/v")))
    ops.append(one("attention", "d[q_nope | q_rope] concatenated: the query projection's output gradient", Made(
        "grad/q up output", z.full(z.a_t * w.qk), "q_nope and q_rope were split from the query projection's"
        " output: their gradients concatenated"), ("grad/q", "grad/query rope")))


def _up(ops: list[Op], z: Sizes, w: Widths) -> None:
    """From the splits' concatenations to the latent norms' dX: the up projections (or q_proj), the norms."""
    ops.append(linear(z, "attention.linear_kv_up_proj", ledger.MLA_KV_UP_IN, "grad/kv up output", w.kv_latent,
                       "grad/kv up input"))
    q, x, width, dx = (("q_up_proj", ledger.MLA_Q_UP_IN, w.q_latent, "grad/q up input") if w.q_latent is not None
                       else ("q_proj", ledger.QKV_IN, z.h, "grad/q input"))  # q_proj runs where q_up_proj would, on x
    ops.append(linear(z, f"attention.linear_{q}", x, "grad/q up output", width, dx))
    for x, norm, width in (("kv", megatron.MLA_KV_NORM, w.kv_latent), ("q", megatron.MLA_Q_NORM, w.q_latent)):
        if width is not None:  # the probe's norm inside megatron's spec
            where = f"attention.{x}_layernorm.norm"
            dw = f"grad/{where} weights"
            ops.append(backward_only(where, norm_kernel(z, where, f"grad/{x} up input", f"grad/{x} latent",
                                                        z.seq(width), dw, hands_over=(dw,)), saves=tuple(norm)))


def _down(ops: list[Op], z: Sizes, w: Widths) -> str:
    """From the latent norms' dX to the attention's input gradient: the kv down output's concatenation, the down
    projections (under tp on this rank's columns of dY, under SP gathered along s first), x's two gradients summed.
    Returns the sum's name.

    ModTracker leaves a module in backward only as the node that made its input runs: MemTracker reads the ops
    before each down projection inside the module whose backward ran before them, still active (q_layernorm's norm,
    whose input q_down_proj makes, or without a query latent q_proj, on x; then kv_down_proj, on x)."""
    between: list[Op] = []
    latent = _whole_sequence(between, z, "grad/kv latent", w.kv_latent)  # under SP a shard: scattered
    between.append(one("attention", "d[latent | k_rope] concatenated: kv_down_proj's output gradient", Made(
        "grad/kv down output", z.full(w.kv_latent + w.rope), "the latent and the key's RoPE part were split"
        " from kv_down_proj's output: their gradients concatenated"), (latent, "grad/key rope")))
    down = (("attention.linear_kv_down_proj", "grad/kv down output", w.kv_latent + w.rope, "grad/kv down input"),
            *((("attention.linear_q_down_proj", "grad/q latent", w.q_latent, "grad/q input"),) if w.q_latent else ()))
    summed = Step("the two input gradients summed", (Made(
        "grad/attention input", z.seq(z.h), "x feeds the query's and the key/value's projections: their gradients"
        " summed"),), frees=("grad/kv down input", "grad/q input"))
    active = "attention.q_layernorm.norm" if w.q_latent else "attention.linear_q_proj"
    for i, (where, grad, width, dx) in enumerate(down):
        whole = grad if i == 0 else _whole_sequence(between, z, grad, width)  # the query latent, scattered back
        columns = _this_ranks_columns(between, z, whole, width)
        ops.extend(replace(x, shadow=active) for x in between)
        between.clear()
        ops.append(linear(z, where, ledger.QKV_IN, columns, z.h, dx,
                          then=summed if i == len(down) - 1 and z.t > 1 else None))
        active = where
    if z.t == 1:  # ColumnParallelLinear's copy_to_tensor_model_parallel_region: x's gradients meet after it
        ops.append(backward_only(where, summed))
    return "grad/attention input"


def _whole_sequence(ops: list[Op], z: Sizes, grad: str, width: int) -> str:
    """Under SP a latent's sequence shard is scattered out of the gathered one (scatter_to_sequence_parallel_region):
    the scatter's backward all-gathers dY along s, a new tensor."""
    return _collective(ops, z.sp, grad, "gathered", "the scatter's backward: dY all-gathered along s", z.full(width),
                       "the scatter's backward all-gathers dY along s: (s, b, width)")


def _this_ranks_columns(ops: list[Op], z: Sizes, grad: str, width: int) -> str:
    """Under tp a down projection is column-parallel and its output gathered over t
    (gather_from_tensor_model_parallel_region): the gather's backward keeps this rank's columns of dY, a copy."""
    return _collective(ops, z.t > 1, grad, "columns", "the gather's backward: this rank's columns",
                       z.full(width // z.t), "the all-gather's backward: this rank's columns of dY, copied")


def _collective(ops: list[Op], runs: bool, grad: str, suffix: str, what: str, nbytes: int, why: str) -> str:
    """A collective's backward (if it `runs`): dY into a new tensor, named f"{grad} {suffix}", and dY gone. Returns
    the gradient's name after it."""
    if not runs:
        return grad
    ops.append(one("attention", what, Made(f"{grad} {suffix}", nbytes, why), (grad,)))
    return f"{grad} {suffix}"


def _core(ops: list[Op], config: ModelConfig, z: Sizes, w: Widths, dcontext: str, has: Has) -> None:
    """DotProductAttention's backward (baddbmm, softmax, dropout, bmm), in backward order. Under selective
    recomputation megatron's CheckpointFunction wraps it: it keeps Q, K, V (and attn_mask_type) and holds dY; in
    backward it reruns the core (its scores live until the core returns), runs the core's backward on the rerun's
    output, each of dQ, dK, dV copied into its detached input's layout, and when it returns its inputs, the rerun's
    output and dY go."""
    selective = config.recompute == "selective"
    core: list[Op] = []
    _core_backward(core, config, z, w, () if selective else (dcontext,), has, selective)
    if not selective:
        ops.extend(core)
        return
    held = {x.name for x in (ledger.MLA_Q, ledger.MLA_K, ledger.MLA_V)}
    again = {x.name: x for op in core for x in op.saves if x.name not in held}.values()
    # the rerun runs the core module's forward (MemTracker files what it makes as activations, inside the core); its
    # backward then runs inside the checkpoint's, where ModTracker hooks no module: MemTracker reads the attention's
    scores = Made("attention/recomputed scores", z.act * z.b * z.a_t * z.s * z.s,
                  "the rerun's baddbmm output: a local of the core's forward until it returns", category=ACTIVATIONS)
    ops.append(backward_only(CORE, Step("selective recomputation: the core's forward again", (
        scores, *(Made(x.name, 0, "made again by selective recomputation's rerun of the core", keeps=x,
                       category=ACTIVATIONS) for x in again),
        Made("attention/recomputed context", z.full(z.a_t * w.v), "the rerun's bmm output, before its copy",
             category=ACTIVATIONS),
        Made("attention/recomputed output", z.full(z.a_t * w.v),
             "the rerun's output: the checkpoint holds it while autograd runs the core's backward",
             category=ACTIVATIONS)),
        frees=(scores.name, "attention/recomputed context"))))
    ops.extend(replace(x, shadow="attention") for x in core)
    ops.append(backward_only("attention", Step("the checkpoint returns", frees=(
        "attention/recomputed output", dcontext)), saves=(ledger.MLA_Q, ledger.MLA_K, ledger.MLA_V, ATTN_MASK_TYPE)))


def _core_backward(ops: list[Op], config: ModelConfig, z: Sizes, w: Widths, frees: tuple[str, ...], has: Has,
                   selective: bool) -> None:
    """The core's own backward; `frees`: what the bmm's backward frees (dY, unless the checkpoint holds it). Under
    selective recomputation each of dQ, dK, dV is then copied into its checkpoint input's layout (AccumulateGrad
    on the detached input: new_empty_strided)."""
    copied = " raw" if selective else ""  # under selective recomputation, before its copy into the input's layout
    ops.append(backward_only(CORE, Step("weights x V: dV and dWeights", (
        Made(f"grad/v{copied}", z.full(z.a_t * w.v), "bmm's backward: dV = weights^T dY"),
        Made("grad/attention weights", z.act * z.b * z.a_t * z.s * z.s, "bmm's backward: dWeights = dY V^T")),
        frees=frees), saves=(ledger.MLA_V, ledger.ATTN_DROPOUT_OUT if has(ledger.ATTN_DROPOUT_MASK.name) else
                             ledger.SOFTMAX_OUT)))
    ops.extend(_copied("v", z.full(z.a_t * w.v), selective))
    softmax(ops, config, z, "grad/attention weights", has, dropout_at=CORE_DROPOUT, softmax_at=CORE_SOFTMAX,
            scale=(SOFTMAX_SCALE,), masks_a_view=True)
    qk = z.full(z.a_t * w.qk)
    ops.append(backward_only(CORE, *(
        step for x, other in (("q", "K"), ("k", "Q")) for step in (
            Step(f"baddbmm's backward: d{x.upper()} = dScores {other}", (
                Made(f"grad/{x} unscaled", qk, f"baddbmm's backward: d{x.upper()} before its scale"),)),
            Step(f"d{x.upper()} scaled", (Made(f"grad/{x}{copied}", qk, "scaled by 1/sqrt(d_n+d_r), a new tensor"),),
                 frees=(f"grad/{x} unscaled", *(("grad/scores",) if x == "k" else ()))))),
        saves=(ledger.MLA_Q, ledger.MLA_K)))
    ops.extend(op for x in ("k", "q") for op in _copied(x, qk, selective))


def _copied(x: str, nbytes: int, selective: bool) -> tuple[Op, ...]:
    """Under selective recomputation: d`x` copied into the layout of the checkpoint's detached input (its .grad), by
    that leaf's AccumulateGrad, after the node that made it has returned."""
    if not selective:
        return ()
    return (one(CORE, f"d{x.upper()} into its input's layout", Made(
        f"grad/{x}", nbytes, "AccumulateGrad on the checkpoint's detached input: a copy in the input's strides"),
        (f"grad/{x} raw",)),)


def _rope(ops: list[Op], part: str, width: int, expanded: bool) -> None:
    """apply_rotary_pos_emb's backward on the key's (one head, expanded to every head: the expand's backward sums
    dK's RoPE part first) or the query's RoPE part of `width` bytes. Forward ran t[..., :d_r], MLA's even/odd
    interleave (cat of t[..., 0::2] and t[..., 1::2]), then t * cos + rotate_half(t) * sin, each product keeping
    its cast table. Leaves f"grad/{part} rope"."""
    p = part[0]
    cos, sin = (x for x in megatron.MLA_ROPE if x.name.startswith(f"mla/rope_{p}_"))
    g = f"grad/{part} rope"
    incoming: tuple[str, ...] = ()
    if expanded:
        ops.append(one("attention", f"the {part}'s RoPE part: the expand over heads' backward", Made(
            f"{g} summed", width, "expand's backward: dK's RoPE part summed over the heads"), ()))
        incoming = (f"{g} summed",)
    made = {  # name: why, each (s, b, heads, d_r) but rotate_half's negated half
        "sin": "rotate_half(t) * sin's backward: dY * sin", "neg": "rotate_half's backward: a half negated",
        "rotated": "rotate_half's backward: the halves concatenated", "cos": "t * cos's backward: dY * cos",
        "t": "the products' gradients of t summed", "odd": "t[..., 1::2]'s backward", "even": "t[..., 0::2]'s backward",
        "interleaved": "the even and odd halves' gradients summed", "sliced": "t[..., :d_r]'s backward",
    }

    def m(name: str, nbytes: int = width) -> Made:
        return Made(f"{g} {name}", nbytes, made[name])

    def names(*xs: str) -> tuple[str, ...]:
        return tuple(f"{g} {x}" for x in xs)

    ops.extend((
        backward_only("attention", Step("rotate_half(t) * sin", (m("sin"),)), saves=(sin,)),
        backward_only("attention", Step("rotate_half: the negated half", (m("neg", width // 2),)),
                  Step("rotate_half: concatenated", (m("rotated"),), frees=names("sin", "neg"))),
        backward_only("attention", Step("t * cos", (m("cos"),)), saves=(cos,)),
        backward_only("attention", Step("the two gradients of t summed", (m("t"),), frees=names("rotated", "cos")),
                  Step("the interleave: t[..., 0::2]", (m("odd"),)),
                  Step("the interleave: t[..., 1::2]", (m("even"),), frees=names("t")),
                  Step("the interleave's gradients summed", (m("interleaved"),), frees=names("odd", "even")),
                  Step("t[..., :d_r]", (m("sliced"),), frees=incoming),
                  Step(f"the {part}'s RoPE input gradient", (Made(g, width, "the RoPE part's input gradient"),),
                       frees=names("sliced", "interleaved"))),
    ))


def host_scalars(config: ModelConfig, z: Sizes, accounting: Accounting) -> tuple[SavedTensor, ...]:
    """What a layer keeps beside the ledger that CUDA keeps in host memory, counted on the CPU alone (its memory is
    the device's there): the fused softmax's scale, or under selective recomputation the checkpoint's
    attn_mask_type; under full recomputation nothing (the forward runs without autograd). The softmax's scale is
    then made by the rerun alone (`rerun_host_scalars`)."""
    if accounting.device != "cpu" or config.recompute == "full":
        return ()
    if config.recompute == "selective":
        return (ATTN_MASK_TYPE,)
    return (SOFTMAX_SCALE,) if fused_softmax(config, z) else ()


def rerun_host_scalars(config: ModelConfig, z: Sizes, accounting: Accounting) -> tuple[SavedTensor, ...]:
    """The host scalars recomputation's rerun (of the core, or of the layer) makes again (on the CPU): the fused
    softmax's scale."""
    again = config.recompute != "none"
    return (SOFTMAX_SCALE,) if again and accounting.device == "cpu" and fused_softmax(config, z) else ()


def beside_the_ledger(tape: Tape, config: ModelConfig, z: Sizes, i: int, first: int) -> None:
    """Before layer i's forward moment: what megatron made in the first step and keeps, which a tracker started
    before this step first sees in layer i's forward: its RotaryEmbedding's lru-cached frequencies (fp32, (s, 1, 1,
    d_r): each layer's module has its own), and in the first layer walked the global memory buffer ("mpu") the
    core's baddbmm writes its scores into, (b*a/t, s, s) in the activation dtype."""
    if i == first:  # under SP megatron's linears all-gather their inputs into the same buffer: the largest request
        gathered = (z.h, config.kv_lora_rank, config.q_lora_rank or 0) if z.sp else ()
        requests = (z.b * z.a_t * z.s * z.s, *(z.b * z.s * x for x in gathered))  # elements
        tape.add(GLOBAL_MEMORY_BUFFER, ACTIVATIONS, z.act * max(requests),
                 "parallel_state's global memory buffer: the core's baddbmm writes its scores into it (under SP the"
                 " linears' all-gathered inputs too), allocated at the largest request")
    tape.add(f"layers.{i}/rotary frequencies", ACTIVATIONS, 4 * z.s * config.qk_rope_head_dim,
             "RotaryEmbedding.forward is lru-cached: its fp32 frequencies outlive the step")
