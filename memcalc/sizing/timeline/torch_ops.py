"""torch ops that more than one library's step walk runs alike, described once: nn.Linear (transformers' and
torchtitan's), dropout as transformers' probe runs it (its shim's native_dropout) and a SwiGLU FeedForward up to its
down projection (torchtitan's dense FeedForward, its MoE's shared and grouped experts), and the matmuls' backward of
transformers' eager_attention_forward (Llama's core and gpt-oss's, with its sinks).
"""

from __future__ import annotations

from dataclasses import replace

from memcalc.model.ledger import SavedTensor
from memcalc.sizing.timeline.tape import Sizes
from memcalc.sizing.timeline.walk import Made, Op, Step, kept, kept_name, kept_names

WHY_WGRAD = "the weight's bf16 gradient, added into the fp32 buffer when autograd hands it over"
WHY_BGRAD = "the bias's bf16 gradient, dY summed over the tokens (sum_to), handed over with the weight's"


def linear(where: str, x: SavedTensor | None, out: Made | None, weight: int, dx: str, dx_bytes: int, p: str,
           frees: tuple[str, ...] = (), sums: tuple[str, str, int] | None = None, dw: str = "", reduced: bool = False,
           waits: bool = False, bias: int = 0, label: str = "") -> Op:
    """nn.Linear (F.linear: one mm; or torch._grouped_mm over every expert): its output `out` (None: the caller's
    forward); in backward dW = dY^T X and dX = dY W beside dY, then `frees` (dY, unless it lives on) with what the op
    saves, and dW is handed over (unless it `waits` in autograd's buffer, tied). `dw`: the weight's gradient's name,
    by default the module's.

    `sums` (the other gradient, the sum's name, its bytes): the input has a gradient already, and autograd sums dX
    into it before dW reaches its accumulator (ZeRO-2 reduces there): matmul views the input after weight.t(), so
    the view's backward, and the sum, run before t()'s; addmm's (`bias`) viewed it before, and so runs after the
    accumulators, as under tp does dX's all-reduce, the sum after it (MemTracker's readings, test_hf_zero_step).
    `bias` (Qwen2's q, k, v): addmm's node passes dY on as the bias's gradient, summed to its shape after the node
    returned (`Step.reduced`) while dY lives; the GEMMs are a moment of their own (under a checkpoint the node's saved
    tensors, the rerun's, go before the sum). `reduced`: a colwise linear under tp, whose Partial dX
    DTensor.from_local's backward all-reduces into a new tensor (the paper's f). `label`: what names the GEMMs where one module runs several (GroupedExperts: "w1's grouped ").
    """
    stem = "/".join(n for n in ("grad", p, where) if n)
    dw = dw or f"{stem} weight"
    biased = (Made(f"{stem} bias", bias, WHY_BGRAD),) if bias else ()
    handed = (*(n.name for n in biased), *(() if waits else (dw,)))  # addmm's bias's accumulator runs first
    summed = sums and not reduced and not bias  # the accumulators run after the sum
    partial = f"{dx} (partial)" if reduced else dx
    gemms = Step(f"{label}GEMMs: dW and dX", (
        Made(dw, weight, "the tied weight's gradient, waiting in autograd's input buffer" if waits else WHY_WGRAD),
        Made(partial, dx_bytes, "dX = dY W" + (", this rank's partial sum" if reduced else ""))),
        () if bias else frees, () if bias or summed else handed, returns=True)
    after = (Step("the bias's gradient: dY summed over the tokens", biased, frees, () if summed else handed,
                  reduced=True),) if bias else ()
    if reduced:
        after += (Step("dX all-reduced", (Made(dx, dx_bytes, "the input's gradient all-reduced over the ranks (DTensor:"
                                                             " Partial -> Replicate)"),), frees=(partial,)),)
    if sums:
        after += (Step("autograd sums the input's two gradients", (Made(
            sums[1], sums[2], "the input's gradient: both uses' summed"),), frees=(dx, sums[0]),
            hands_over=handed if summed else ()),)
    return Op(where, (Step(f"{label}GEMM" if label else "the GEMM", (out,)),) if out else (), (gemms, *after),
              saves=(x,) if x else ())


def tied_sum(table: int) -> Step:
    """A tied embedding's gradient: autograd's input buffer sums the output layer's (waiting there since its
    backward) with the lookup's into a new tensor, "grad/embedding (sum)", before the weight's accumulator runs."""
    return Step("the tied weight's two gradients summed", (Made(
        "grad/embedding (sum)", table, "autograd sums the tied weight's two gradients into a new tensor"),))


def dropout(where: str, p: str, mask: SavedTensor, output: Made, dx: str, dx_bytes: int,
            gone: tuple[str, ...] = (), frees: tuple[str, ...] = (), then: Step | None = None,
            reads: tuple[str, ...] = ()) -> Op:
    """nn.Dropout (and F.dropout) in training: the probe's shim runs CUDA's native_dropout, its output and a bool
    mask, which backward multiplies dY by (scaled) into a new `dx`; `gone`: the input, rebound as it returns (`reads`:
    a kept one, read last); `frees`: dY, unless it lives on (the residual stream's); `then`: what goes after it (the
    module around it returns)."""
    return Op(where, (Step("native_dropout: its output and bool mask", (output, kept(p, mask)), frees=gone,
                           reads_last=(*reads, kept_name(p, mask))),
                      *((then,) if then else ())), (
        Step("native_dropout_backward: dY * mask * scale", (Made(dx, dx_bytes, "dropout's backward"),),
             frees=frees),), saves=(mask,))


def swiglu_ops(p: str, m: str, tensors: tuple[SavedTensor, ...], w: int, f: int, x: int, dx: str,
               grouped: dict[str, str] | None = None) -> tuple[Op, ...]:
    """A SwiGLU FeedForward `m` up to w2: w1, SiLU, w3 and the product, keeping `tensors` (its input, SiLU's input
    and output, w3's output, the product); w1's and w3's dX summed into `dx`. `w`: a weight's bytes, `f`: a (b, s, f)
    tensor's, `x`: the input's. `grouped`: GroupedExperts' parameters by weight (w1 -> w1_EFD), one module whose
    grouped GEMMs run every expert, each weight's gradient named by its parameter."""
    x_in, gate, silu, up, product = tensors
    g = f"grad/{p}/{m}"
    where = {n: m if grouped else f"{m}.{n}" for n in ("w1", "w3")}
    dw = {n: f"{g}/{grouped[n]}" if grouped else "" for n in ("w1", "w3")}
    label = {n: f"{n}'s grouped " if grouped else "" for n in ("w1", "w3")}
    return (
        linear(where["w1"], x_in, kept(p, gate), w, f"{g}/dx1", x, p, frees=(f"{g}/dgate",),
               sums=(f"{g}/dx3", dx, x), dw=dw["w1"], label=label["w1"]),
        # SiLU runs inside the FeedForward; its backward while MemTracker still has w3 active (w1 x and w3 x share an
        # input, whose gradient is not complete until w1's backward)
        Op(where["w3"], forward=(Step("SiLU", (kept(p, silu),), reads_last=(kept_name(p, gate),)),),
           backward=(Step("SiLU's backward", (Made(f"{g}/dgate", f, "bf16"),), frees=(f"{g}/dsilu",)),),
           saves=(gate,)),
        linear(where["w3"], x_in, kept(p, up), w, f"{g}/dx3", x, p, frees=(f"{g}/dup",), dw=dw["w3"],
               label=label["w3"]),
        Op(m, forward=(Step("SiLU(w1 x) * w3 x", (kept(p, product),),
                            reads_last=kept_names(p, silu, up)),),
           backward=(Step("the product's backward: dY * up", (Made(f"{g}/dsilu", f, "bf16"),)),
                     Step("the product's backward: dY * SiLU", (Made(f"{g}/dup", f, "bf16"),), frees=(f"{g}/dfc2",))),
           saves=(up, silu)),
    )


def module_returns(ops: tuple[Op, ...], *names: str) -> tuple[Op, ...]:
    """`ops`, the last of a module's, with `names` (kept tensors its frame holds: its input, locals) read last by
    their final forward step, where the module returns."""
    *before, last = ops
    *steps, final = last.forward
    return (*before, replace(last, forward=(*steps, replace(final, reads_last=final.reads_last + names))))


def core_backward(g: str, z: Sizes, gqa: bool, weights: str, scores: int) -> tuple[tuple[Step, ...], Step,
                                                                                    tuple[Step, ...]]:
    """What eager_attention_forward's backward makes alike in Llama's core and gpt-oss's (with the sinks): repeat_kv's
    sums over each group's heads (`gqa`), QK^T's dQ and dK, and weights x V's dV and dWeights (`weights`, of
    `scores` bytes) after dY made (b, a, s, d)."""
    q = z.full(z.a_t * z.d)
    names = {n: f"{g}/{n} {'expanded' if gqa else 'heads'}" for n in ("k", "v")}
    sums = tuple(Step("repeat_kv's backward", (Made(f"{g}/{n} heads", z.full(z.g_t * z.d), f"d{n} summed over each"
                                                    " group's heads"),), frees=(f"{g}/{n} expanded",), moment=False)
                 for n in ("v", "k")) if gqa else ()
    qk = Step("QK^T: dQ and dK", (Made(f"{g}/q heads", q, "dQ = dScores K"), Made(
        names["k"], q, "dK = dScores^T Q, at a heads")), frees=(f"{g}/scaled scores",))
    context = (Step("the context made (b, a, s, d)", (Made(f"{g}/attn heads", q, "contiguous for bmm"),),
                    frees=(f"{g}/o_proj input",), moment=False),
               Step("weights x V: dV and dWeights", (Made(names["v"], q, "dV = weights^T dY, at a heads"), Made(
                   weights, scores, "dWeights = dY V^T")), frees=(f"{g}/attn heads",)))
    return sums, qk, context
