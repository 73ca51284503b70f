"""torchtitan's modules that its blocks and the model's ends share, as ops for the step walk: nn.RMSNorm (torch's CPU
composite and CUDA's fused kernel), the pre-norm with its residual gradient's sum and the first residual sum, its
sequence-parallel collectives (the all-gather at a module's entry, the reduce-scatter at a row-parallel linear's
exit, f and f* under tp) and ComplexRoPE; Llama3's blocks (memcalc.sizing.timeline.torchtitan) and DeepSeek-V3's
latent attention (memcalc.sizing.timeline.torchtitan_mla) are made of them. docs/timeline.md, "torchtitan's
Llama3Model".
"""

from __future__ import annotations

from memcalc.model import ledger
from memcalc.model.impls import torchtitan as rules
from memcalc.model.ledger import SavedTensor
from memcalc.sizing.timeline.tape import Sizes
from memcalc.sizing.timeline.torch_ops import WHY_WGRAD
from memcalc.sizing.timeline.torchtitan_moe import permuted_stream_grad
from memcalc.sizing.timeline.walk import Made, Op, Step, kept, kept_name, kept_names


def norm(where: str, z: Sizes, norm: rules.RMSNormTensors, p: str, out: Made, grad: str, dx: str, x: str,
         frees: tuple[str, ...] = (), stream: str = "", rows: int = 0, width: int = 0) -> Op:
    """nn.RMSNorm: on CUDA torch's fused kernel (`fused_rms_norm`, keeping its input `x` itself), on a CPU torch's
    rms_norm_composite, op by op, and its backward through autograd.

    The composite's forward keeps the fp32 input, the rstd and x * rstd (the ledger's); `frees` go once the output
    is made. Backward ends with dX cast back to bf16 (`dx`). In fp32 the input is x itself, so autograd adds x's two
    gradients into the residual stream's (`stream`, its gradient; `dx` then the sum) as each comes. It normalises
    `rows` rows of `width` channels: by default each token's h (under SP this rank's sequence shard's), Qwen3's head
    norms each head's d.
    """
    tokens, width = rows or z.b * z.s_seq, width or z.h
    if z.cuda:
        return fused_rms_norm(where, z, norm, p, out, grad, dx, x, z.act * tokens * width)
    n, full, row = f"{p}/{where}" if p else where, 4 * tokens * width, 4 * tokens
    fp32, rstd, normed = kept_names(p, norm.input_fp32, norm.rstd, norm.normed_fp32)
    # under a checkpoint (which keeps none of them) x * rstd goes after the weight multiply, the upcast input before
    # the cast back
    times = (Made(f"{n}/weighted", full, "x * rstd * weight, a local"),)
    weighted = (Step("times the weight, in fp32", times, reads_last=(normed, fp32)),)
    # its input is spmd_types' reduce-scatter's (s/t, b, h) output seen as (b, s/t, h), not contiguous (DTensor's
    # reduce-scatter along s makes (b, s/t, h) itself; a pipeline stage's received input is its (b, s/t, h) receive
    # buffer, whose layout every residual sum on the stage keeps: `Sizes.stage_receives`); a head norm's input is
    # the split's contiguous copy
    if z.sp and z.b > 1 and not z.dtensor and not z.stage_receives and not rows:
        weighted = (Step("times the weight, in fp32", times, reads_last=(normed,)),
                    Step("made contiguous", (Made(f"{n}/copy", full, "fp32, a local"),), frees=(f"{n}/weighted",),
                         reads_last=(fp32,)))
    cast = z.act != 4  # in fp32 input.to(float32) is x itself, kept by the norm, and the weighted product the output
    if not cast:
        fp32 = x
    head = (
        *((Step("input.to(float32)", (kept(p, norm.input_fp32),)),) if cast else ()),
        Step("pow(2)", (Made(f"{n}/pow", full, "x^2, a local"),)),
        Step("mean over h", (Made(f"{n}/mean", row, "mean(x^2), a local"),)),
        Step("rsqrt(mean + eps)", (kept(p, norm.rstd),), frees=(f"{n}/pow", f"{n}/mean")),
        Step("x * rstd", (kept(p, norm.normed_fp32),)),
    )
    forward = (*head, *weighted, Step("cast back to bf16: the norm's output", (out,),
                                      frees=(f"{n}/weighted", f"{n}/copy", *frees), reads_last=(rstd,))) if cast else (
        *head, Step("times the weight: the norm's output", (out,), frees=tuple(f for f in frees if f != x),
                    reads_last=(normed, rstd)))
    g = f"grad/{n}"
    # in fp32 dY is the output's gradient itself, the summed product the weight's gradient, and x's summed gradients dX
    dy, dw = (f"{g}/dy", f"{g}/dw fp32") if cast else (grad, f"{g}/dweight")
    weight_grad = (Step("cast to bf16: the weight's gradient", (Made(f"{g}/dweight", z.weight(where), WHY_WGRAD),),
                        frees=(dy, dw, normed), hands_over=(f"{g}/dweight",)),) if cast else (
        Step("", frees=(dy, normed), hands_over=(dw,)),)
    backward = (
        *((Step("the cast's backward: dY up to fp32", (Made(dy, full, "dY in fp32"),), frees=(grad,)),)
          if cast else ()),
        Step("times the weight's backward: dY * weight", (Made(f"{g}/dnormed", full, "the gradient of x * rstd"),)),
        Step("its weight's: dY * (x * rstd)", (Made(f"{g}/dw full", full, "per token, before the sum"),),
             reads_last=(normed,)),
        Step("summed over tokens", (Made(dw, z.weight(where, 4), "the weight's fp32 gradient"),),
             frees=(f"{g}/dw full",)),
        *weight_grad,
        Step("x * rstd's backward: dnormed * rstd", (Made(f"{g}/dx (x * r)", full, "x's first fp32 gradient"),)),
        Step("x * rstd's backward: dnormed * x", (Made(f"{g}/dr full", full, "per element, before the sum"),)),
        Step("summed over h: rstd's gradient", (Made(f"{g}/dr", row, "(b, s, 1) fp32"),),
             frees=(f"{g}/dnormed", f"{g}/dr full")),
        *((Step("x's first gradient added to the residual stream's", (Made(f"{g}/dx (sum)", full, "a new tensor"),),
                frees=(f"{g}/dx (x * r)", stream)),) if stream else ()),
        Step("rsqrt's backward: rstd^3", (Made(f"{g}/r^3", row, "(b, s, 1) fp32"),)),
        Step("rsqrt's backward: -rstd^3 / 2", (Made(f"{g}/-r^3 / 2", row, "(b, s, 1) fp32"),)),
        Step("rsqrt's backward: times dr", (Made(f"{g}/dvariance", row, "(b, s, 1) fp32"),),
             frees=(f"{g}/dr", f"{g}/r^3", f"{g}/-r^3 / 2", rstd)),
        Step("mean's backward: spread over h, divided by h", (Made(f"{g}/dpow", full, "the gradient of x^2"),),
             frees=(f"{g}/dvariance",)),
        Step("pow's backward: x^1", (Made(f"{g}/x^1", full, "pow(x, 1), a copy"),)),
        Step("pow's backward: 2 x", (Made(f"{g}/2x", full, "fp32"),)),
        Step("pow's backward: dpow * 2x", (Made(f"{g}/dx (pow)", full, "x's second fp32 gradient"),),
             frees=(f"{g}/x^1", f"{g}/2x", f"{g}/dpow", fp32)),
        Step("autograd sums x's two fp32 gradients", (Made(f"{g}/dx fp32" if cast else dx, full, "fp32"),),
             frees=(f"{g}/dx (sum)" if stream else f"{g}/dx (x * r)", f"{g}/dx (pow)")),
        *((Step("input.to(float32)'s backward: dX cast back to bf16", (Made(dx, z.act * tokens * width, "the norm's"
                                                                           " dX"),), frees=(f"{g}/dx fp32",)),)
          if cast else ()),
    )
    return Op(where, forward, backward, saves=(*((norm.input_fp32,) if cast else ()), norm.rstd, norm.normed_fp32))


def fused_rms_norm(where: str, z: Sizes, tensors: rules.RMSNormTensors, p: str, out: Made, grad: str, dx: str,
                   x: str, dx_bytes: int) -> Op:
    """nn.RMSNorm on CUDA: torch's _fused_rms_norm, one kernel each way (a non-contiguous input's copy is its own,
    as its workspace). Forward makes the output and the fp32 rstd; it keeps the input `x` (the residual stream's
    tensor itself: the ledger's input term) and rstd; backward makes dX and the weight's gradient beside dY, then
    dY, `x` and rstd go (`dx_bytes`: dX's size, its input's)."""
    n = f"{p}/{where}" if p else where
    rstd, dweight = kept_name(p, tensors.rstd), f"grad/{n}/dweight"
    return Op(where, forward=(
        Step("_fused_rms_norm: the output and rstd", (out, kept(p, tensors.rstd)), reads_last=(rstd,)),
    ), backward=(
        Step("_fused_rms_norm_backward: dX and the weight's gradient", (
            Made(dx, dx_bytes, "the norm's dX"), Made(dweight, z.weight(where), WHY_WGRAD)),
            frees=(grad, x), hands_over=(dweight,)),
    ), saves=(tensors.rstd,))


def gather(where: str, z: Sizes, p: str, out: Made, dx: str, rs: str, frees: tuple[str, ...] = ()) -> tuple[Op, ...]:
    """SP's all-gather along s at a module's entry (its plan declares the input Replicate): the shards into a (t, b,
    s/t, h) buffer, concatenated into (b, s, h) (`out`, which the column-parallel linears keep), then `frees`. In
    backward dX (`dx`, whole) made s-first and reduce-scattered into this rank's shard (`rs`). Under tp without SP
    the paper's f: nothing in forward, dX all-reduced into a copy (`rs`) in backward. None at t = 1."""
    if z.t > 1 and not z.sp:
        return (Op(where, forward=(), backward=(
            Step("f's backward: dX all-reduced into a copy", (Made(rs, z.full(z.h), "(b, s, h), summed"),),
                 frees=(dx,)),)),)
    if not z.sp:
        return ()
    n, g = f"{p}/{where}" if p else where, f"grad/{p}/{where}" if p else f"grad/{where}"
    return (Op(where, forward=all_gather(f"{n} gathered", out, z, "concatenated along s", frees),
               backward=reduce_scattered(f"{g} s-first", z, "dX", Made(rs, z.seq(z.h), "this rank's shard of dX"),
                                          (dx,))),)


def all_gather(buffer: str, out: Made, z: Sizes, what: str, frees: tuple[str, ...]) -> tuple[Step, ...]:
    """SP's all-gather along s: the shards into a (t, b, s/t, h) buffer, concatenated into (b, s, h) (`out`, `what`),
    then the buffer and `frees` go. On DTensor at b = 1 the buffer, (t, 1, s/t, h), is (1, s, h) already: `out`."""
    if z.dtensor and z.b == 1:
        return (Step("the all-gather's output", (out,), frees=frees),)
    return (Step("the all-gather's buffer", (Made(buffer, z.full(z.h), "(t, b, s/t, h)"),)),
            Step(what, (out,), frees=(buffer, *frees)))


def reduce_scattered(name: str, z: Sizes, what: str, out: Made, frees: tuple[str, ...],
                      label: str = "the reduce-scatter's output", then: tuple[str, ...] = ()) -> tuple[Step, ...]:
    """SP's reduce-scatter along s of `what` into this rank's shard (`out`, made at `label`), then `frees` go, the
    copy, and `then` (the module's own locals). Its input is first made (s, b, h)-contiguous (`name`): a copy, but at
    b = 1, where the permuted view is (on DTensor a copy always: its reduce-scatter along s concatenates the chunks)."""
    copy = () if z.b == 1 and not z.dtensor else (
        Step(f"{what} made s-first for the reduce-scatter", (Made(name, z.full(z.h), "(s, b, h)"),)),)
    return (*copy, Step(label, (out,), frees=(*frees, name, *then)))


def gathered_dy(g: str, z: Sizes, gathered: str, frees: tuple[str, ...] = ()) -> tuple[Step, ...]:
    """In backward, dY's shard all-gathered along s into the whole (`gathered`), then `frees` go. The shard is first
    made contiguous (f"{g} dY") where the residual stream's gradient is a permuted view (`permuted_stream_grad`)."""
    copy = () if not permuted_stream_grad(z) else (
        Step("dY made contiguous", (Made(f"{g} dY", z.seq(z.h), "this rank's shard"),)),)
    return (*copy, *all_gather(f"{g} buffer", Made(gathered, z.full(z.h), "(b, s, h)"), z,
                                "concatenated along s: dY whole", (f"{g} dY", *frees)))


def reduce_scatter(where: str, z: Sizes, p: str, partial: str, out: str, gathered: str,
                   frees: tuple[str, ...]) -> tuple[Op, ...]:
    """SP's reduce-scatter of a row-parallel linear's partial sum (`partial`) into this rank's shard (`out`); with it
    `frees` go (the module returns). In backward dY's shard all-gathered whole (`gathered`), the shard itself kept
    for the residual stream. Under tp without SP the paper's f*: the partial sum all-reduced into a copy (`out`), and
    nothing in backward. None at t = 1."""
    if z.t > 1 and not z.sp:
        return (Op(where, forward=(Step("f*: the partial sum all-reduced into a copy", (
            Made(out, z.full(z.h), "(b, s, h), summed"),), frees=(partial,)),), backward=()),)
    if not z.sp:
        return ()
    return (Op(where, forward=reduce_scattered(f"{p}/{where} s-first", z, "the partial sum", Made(
        out, z.seq(z.h), "this rank's shard, summed"), (partial,), then=frees),
               backward=gathered_dy(f"grad/{p}/{where}", z, gathered)),)


def norm_out(z: Sizes, p: str, norm: str, kept_input: SavedTensor) -> Made:
    """A norm's output: the next module's kept input itself, or under SP the shard its all-gather reads."""
    if z.sp:
        return Made(f"{p}/{norm} out" if p else f"{norm} out", z.seq(z.h), "bf16, this rank's shard")
    return kept(p, kept_input)


def keeps_input(z: Sizes) -> bool:
    """Whether the norms keep their input, the residual stream's tensor itself: CUDA's fused kernel, and the CPU
    composite in fp32 (its input.to(float32) a no-op)."""
    return z.cuda or z.act == 4


def stream_after_attention(z: Sizes) -> SavedTensor | None:
    """The ledger's term for the residual stream after attention where ffn_norm keeps it (its input on CUDA, its fp32
    input in fp32 on a CPU); None where it is a local of the block."""
    if z.cuda:
        return rules.LN2.input
    return rules.LN2.input_fp32 if z.act == 4 else None


def pre_norm(where: str, z: Sizes, tensors: rules.RMSNormTensors, p: str, out: Made, grad: str, x: str, stream: str,
             into: str) -> tuple[Op, ...]:
    """A block's norm on the residual stream `x` (`norm`), and in backward its dX and the residual stream's gradient
    `stream` summed into `into` as soon as the norm's returns (autograd does it inside the norm's window): listed
    before the norm, so it runs after it. The forward sum is the branch's last op. On CUDA autograd adds dX into the
    residual stream's gradient, which it holds alone (its input buffer's in-place accumulation, after a fused norm's
    node as after native_layer_norm's; not after the CPU composite's), making nothing. The CPU composite in fp32,
    whose input is the stream's tensor itself, adds x's gradients into the stream's itself (`norm`'s `stream`), with
    no sum of its own."""
    if z.act == 4 and not z.cuda:
        return (norm(where, z, tensors, p, out, grad, into, x, stream=stream),)
    dx = f"grad/{p}/{where} dx"
    summed = Step("the residual stream's gradients summed", (Made(
        into, z.seq(z.h), "the residual stream's gradient: both paths' summed"),), frees=(dx, stream),
        moment=not z.cuda)
    return (Op(where, forward=(), backward=(summed,)), norm(where, z, tensors, p, out, grad, dx, x))


def first_residual(p: str, z: Sizes, mid: str, h: int, attention_out: str) -> Op:
    """x + the attention's output (`attention_out`, which goes): the residual stream after attention (`mid`), on CUDA
    ffn_norm's kept input."""
    kept_mid = stream_after_attention(z)
    return Op("", forward=(Step("x + attention", (kept(p, kept_mid, "the residual stream after attention; ffn_norm"
                                                                 " keeps it") if kept_mid else
                                                 Made(mid, h, "the residual stream after attention"),),
                                frees=(attention_out,)),), backward=())


def attention_kernel(p: str, z: Sizes, widths: tuple[int, int, int], qkv: tuple[SavedTensor, SavedTensor, SavedTensor],
                     out: SavedTensor) -> Op:
    """The attention kernel, SDPA's flash kernel, on CUDA compiled flex (whose Inductor buffers, the row maxima and
    backward's delta, are its workspace): its output `out` (wo's input) and the fp32 log-sum-exp kept, with Q, K and V
    (`qkv`); in backward dQ, dK and dV (`widths`: their bytes) beside dY."""
    g, kernel = f"grad/{p}/attention", "flex attention" if z.cuda else "SDPA's flash kernel"
    q, k, v = widths
    return Op("attention.inner_attention",
              forward=(Step(f"{kernel}: output and log-sum-exp", (kept(p, out), kept(p, ledger.SOFTMAX_LSE)),
                            reads_last=(kept_name(p, ledger.SOFTMAX_LSE),)),),
              backward=(Step(f"{kernel}'s backward: dQ, dK, dV", (
                  Made(f"{g}/dq", q, "bf16"), Made(f"{g}/dk", k, "bf16"), Made(f"{g}/dv", v, "bf16")),
                  frees=(f"{g}/dout",)),),
              saves=(*qkv, ledger.SOFTMAX_LSE, out))


def rope_ops(p: str, z: Sizes, q: int, kv: int, outputs: tuple[Made, Made] | None = None, k_grad: str = "",
             table: SavedTensor = rules.ROPE_CACHE) -> Op:
    """ComplexRoPE: q and k in fp32 times the complex64 table, cast back (Q and K kept); in fp32 .float() and type_as
    are no-ops, the complex products Q and K themselves. On CUDA's flex path, given the batch's positions, the table is
    first gathered at them (kept by both products, until q's backward). DeepSeek-V3's (memcalc.sizing.timeline.
    torchtitan_mla) runs on views of the projections' outputs and makes `outputs` (q's and k's); in backward its dQ is
    a view of SDPA's, and k's gradient (`k_grad`: the expand's sum, or over one head dK itself) goes as k's cast's
    backward returns, where Llama3's SDPA's dQ and dK go as RoPE returns. `table`: the ledger's term for the gathered
    table."""
    g, gathered, cast = f"grad/{p}/attention", kept_name(p, table), z.act != 4
    q_out, k_out = outputs or (kept(p, ledger.Q), kept(p, ledger.K))
    grads = () if k_grad else (f"{g}/dq", f"{g}/dk")
    fp32q, fp32k = 4 * q // z.act, 4 * kv // z.act  # the fp32 copies and their complex64 products
    # the table's conjugate, materialised: the (1, s, 1, d/2) buffer's, or on CUDA the gathered (b, s, 1, d/2) one
    conj = 8 * z.s * (z.d // 2) * (z.b if z.cuda else 1)
    gather = (Step("the table gathered at the positions", (kept(p, table),)),) if z.cuda else ()
    pre = (f"{p}/q pre-rope", f"{p}/k pre-rope") if outputs is None else ()  # DeepSeek-V3's: views

    def conjugate(x: str, nbytes: int, *frees: str, returns: bool = False) -> tuple[Step, ...]:
        """dX (cast up to fp32) times the table's conjugate; in fp32 that is x's gradient before RoPE."""
        into = Made(f"{g}/d{x} rotated", nbytes, "complex64") if cast else Made(
            f"{g}/d{x} pre-rope", nbytes, "complex64, seen as real")
        return (Step(f"the table's conjugate, for {x}", (Made(f"{g}/conj {x}", conj, "complex64"),)),
                Step(f"d{x.upper()} times it", (into,), frees=(f"{g}/conj {x}", *frees), returns=returns))
    if not cast:
        forward = (Step("q times the table: Q", (q_out,)),
                   Step("k times the table: K", (k_out,), frees=pre, reads_last=(gathered,)))
        backward = (*conjugate("k", fp32k), *conjugate("q", fp32q, *grads, returns=True))
    else:
        forward = (Step("q.float()", (Made(f"{p}/q fp32", fp32q, "q in fp32"),)),
                   Step("k.float()", (Made(f"{p}/k fp32", fp32k, "k in fp32"),)),
                   Step("q times the table", (Made(f"{p}/q rotated", fp32q, "complex64"),)),
                   Step("k times the table", (Made(f"{p}/k rotated", fp32k, "complex64"),)),
                   Step("q cast back", (q_out,)),
                   Step("k cast back", (k_out,), frees=(
                       f"{p}/q fp32", f"{p}/k fp32", f"{p}/q rotated", f"{p}/k rotated", *pre),
                       reads_last=(gathered,)))  # the gathered table: a local of its forward
        backward = (
            Step("k's cast's backward: dK up to fp32", (Made(f"{g}/dk fp32", fp32k, "fp32"),), frees=(k_grad,)),
            Step("q's cast's backward: dQ up to fp32", (Made(f"{g}/dq fp32", fp32q, "fp32"),)),
            *conjugate("k", fp32k, f"{g}/dk fp32"),
            *conjugate("q", fp32q, f"{g}/dq fp32", returns=True),
            Step("k.float()'s backward: to bf16", (Made(f"{g}/dk pre-rope", kv, "bf16"),), frees=(f"{g}/dk rotated",)),
            Step("q.float()'s backward: to bf16", (Made(f"{g}/dq pre-rope", q, "bf16"),),
                 frees=(f"{g}/dq rotated", *grads)),
        )
    return Op("attention.rope", (*gather, *forward), backward, saves=(table,) if z.cuda else ())
