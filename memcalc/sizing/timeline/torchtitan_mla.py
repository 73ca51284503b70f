"""torchtitan's DeepSeek-V3 Attention (multi-head latent attention, torchtitan/models/deepseek_v3/model.py) in the
step walk, as ops, keeping the torchtitan ledger's tensors (memcalc.model.impls.torchtitan.latent_attention_block).

Its ops forward and backward, and what is measured of them: docs/timeline.md, "torchtitan's DeepSeek-V3 attention".
"""

from __future__ import annotations

from dataclasses import replace

from memcalc.config.schema import ModelConfig
from memcalc.model import ledger
from memcalc.model.impls import torchtitan as rules
from memcalc.model.ledger import SavedTensor
from memcalc.sizing.timeline import torchtitan as titan
from memcalc.sizing.timeline.megatron_mla import Widths
from memcalc.sizing.timeline.tape import Sizes
from memcalc.sizing.timeline.torch_ops import linear
from memcalc.sizing.timeline.walk import Made, Op, Step, kept, kept_name, kept_names


def latent_attention_ops(p: str, z: Sizes, config: ModelConfig, mid: str, gx: str, gmid: str,
                         h: int) -> tuple[Op, ...]:
    """attention_norm, the Attention (its query path, wkv_a, RoPE on the d_r-wide parts, kv_norm, wkv_b, the two
    concatenations, SDPA, wo) and the first residual sum, in forward order; their backward is the reverse, as
    autograd runs it (the later-made node first among those ready: the key/value path before the query's)."""
    w, a, g = Widths.of(config), "attention", f"grad/{p}/attention"
    full, x = z.full(z.h), kept(p, rules.MLA_IN)
    wq_out, kv_a_out = _query_output(p, w), kept_name(p, cached_as(rules.MLA_WKV_A_OUT, z))
    q_pe, k_pe = f"{p}/q_pe", f"{p}/k_pe"  # RoPE's outputs: locals of the forward until it returns
    wo_out = kept_name(p, rules.WO_OUT)  # its partial sum under tp
    dy = f"{g}/dY whole"  # wo's dY, all-gathered under SP
    kv_up_in, kv_up_out = kept(p, rules.MLA_KV_UP_IN), kept(p, ledger.MLA_KV_UP_OUT)
    # the expand of k_pe over the heads sums dK's RoPE part in backward; over one head it is a view of dK, which then
    # lives until RoPE's backward of k has read it (past the hook on SDPA's inputs, which lets dV go)
    expanded = z.a_t > 1
    k_grad = f"{g}/dk_pe" if expanded else f"{g}/dk"
    expand = (Step("the expand's backward: dk_pe summed over the heads", (
        Made(k_grad, z.tokens(z.act * w.rope), "k_pe's gradient"),)),) if expanded else ()
    rope = titan.rope_ops(p, _with_head_width(z, w.rope), z.tokens(z.act * z.a_t * w.rope), z.tokens(z.act * w.rope),
                          outputs=(Made(q_pe, z.tokens(z.act * z.a_t * w.rope), "RoPE(q_pe), a local"),
                                   Made(k_pe, z.tokens(z.act * w.rope), "RoPE(k_pe), a local")),
                          k_grad=k_grad, table=rules.MLA_ROPE_CACHE)
    return (
        *titan.pre_norm("attention_norm", z, rules.LN1, p, titan._norm_out(z, p, "attention_norm", rules.MLA_IN),
                        f"grad/{p}/attention_norm dy" if z.t > 1 else f"{g}/dx", f"{p}/input", gmid, gx),
        *titan.gather(a, z, p, x, f"{g}/dx", f"grad/{p}/attention_norm dy"),
        *_query_ops(p, z, w, wq_out, full),
        linear(f"{a}.wkv_a", rules.MLA_IN, _latent(p, z, rules.MLA_WKV_A_OUT, w.kv_latent + w.rope),
               z.weight(f"{a}.wkv_a"), f"{g}/wkv_a dx", full, p, frees=(f"{g}/dkv_a",)),
        Op(a, forward=(), backward=(Step("the split's backward: d[latent | k_pe] concatenated", (
            Made(f"{g}/dkv_a", z.tokens(z.act * (w.kv_latent + w.rope)), "wkv_a's output's gradient"),),
            frees=(f"{g}/dkv latent",)),), shadow=f"{a}.rope"),
        rope,
        Op(a, forward=(Step("q = cat(q_nope, q_pe)", (kept(p, ledger.MLA_Q),)),), backward=(
            Step("the hook on SDPA's inputs lets dK and dV go", frees=(f"{g}/dk", f"{g}/dv") if expanded
                 else (f"{g}/dv",)),)),
        titan.norm(f"{a}.kv_norm", z, rules.MLA_KV_NORM, p, kv_up_in, f"{g}/dkv normed", f"{g}/dkv latent",
                   kv_a_out, rows=z.tokens(1), width=w.kv_latent),
        linear(f"{a}.wkv_b", rules.MLA_KV_UP_IN, kv_up_out, z.weight(f"{a}.wkv_b"), f"{g}/dkv normed",
               z.tokens(z.act * w.kv_latent), p, frees=(f"{g}/dkv up",)),
        Op(a, forward=(Step("wkv_a's output goes (kv rebound)", frees=() if z.cuda else (kv_a_out,),
                            reads_last=(kv_up_in.name, kv_a_out)),
                       Step("k = cat(k_nope, k_pe expanded)", (kept(p, ledger.MLA_K),))),
           backward=(*expand,
                     Step("the split's backward: d[k_nope | v] concatenated", (
                         Made(f"{g}/dkv up", z.tokens(z.act * z.a_t * (w.nope + w.v)), "wkv_b's output's gradient"),
                     ))), shadow=f"{a}.inner_attention"),
        Op(f"{a}.inner_attention",
           forward=(Step("SDPA's flash kernel: output and log-sum-exp",
                         (kept(p, ledger.MLA_PROJ_IN), kept(p, ledger.SOFTMAX_LSE)),
                         reads_last=(kept_name(p, ledger.SOFTMAX_LSE),)),),
           backward=(Step("SDPA's flash kernel's backward: dQ, dK, dV", (
               Made(f"{g}/dq", z.tokens(z.act * z.a_t * w.qk), "bf16"),
               Made(f"{g}/dk", z.tokens(z.act * z.a_t * w.qk), "bf16"),
               Made(f"{g}/dv", z.tokens(z.act * z.a_t * w.v), "bf16")), frees=(f"{g}/dout",)),),
           saves=(ledger.MLA_Q, ledger.MLA_K, ledger.MLA_KV_UP_OUT, ledger.SOFTMAX_LSE, ledger.MLA_PROJ_IN)),
        linear(f"{a}.wo", ledger.MLA_PROJ_IN, Made(wo_out, full, "wo's output"), z.weight(f"{a}.wo"), f"{g}/dout",
               z.tokens(z.act * z.a_t * w.v), p, frees=(dy,) if z.sp else ()),
        *titan.reduce_scatter(f"{a}.wo", z, p, wo_out, f"{p}/attention out", dy, ()),
        Op(a, forward=(Step("the Attention returns: its locals go", frees=(
            wq_out, q_pe, k_pe, *((f"{p}/attention_norm out",) if z.sp else ())),
            reads_last=kept_names(p, rules.MLA_IN, ledger.MLA_Q, ledger.MLA_K, ledger.MLA_KV_UP_OUT,
                                  ledger.MLA_PROJ_IN)),), backward=()),
        titan.first_residual(p, z, mid, h, wo_out if z.t == 1 else f"{p}/attention out"),
    )


def _query_output(p: str, w: Widths) -> str:
    """The name of the query projection's output (wq's, or wq_b's), of which q_nope and q_pe are views."""
    return kept_name(p, rules.MLA_WQ_OUT) if w.q_latent is None else f"{p}/wq_b out"


def _query_ops(p: str, z: Sizes, w: Widths, out: str, full: int) -> tuple[Op, ...]:
    """The query projection: wq on x, or wq_a, q_norm and wq_b; in backward the split's d[q_nope | q_pe] concatenated
    first (the query's chain runs after the key/value's), x's gradient summed with wkv_a's."""
    a, g = "attention", f"grad/{p}/attention"
    heads = z.tokens(z.act * z.a_t * w.qk)
    # k's gradient before RoPE, which ModTracker's multi-grad hook on RoPE's inputs holds until q's node starts
    split = Op(a, forward=(), backward=(Step("RoPE's hook lets k's dY go", frees=(f"{g}/dk pre-rope",)),
                                        Step("the split's backward: d[q_nope | q_pe] concatenated", (
                                            Made(f"{g}/dq up", heads, "the query projection's output's gradient"),),
                                            frees=(f"{g}/dq", f"{g}/dq pre-rope"))), shadow=f"{a}.wkv_a")
    summed = (f"{g}/wkv_a dx", f"{g}/dx", full)
    if w.q_latent is None:
        return (linear(f"{a}.wq", rules.MLA_IN, Made(out, heads, "wq's output"), z.weight(f"{a}.wq"), f"{g}/wq dx",
                       full, p, frees=(f"{g}/dq up",), sums=summed), split)
    latent, q_latent = kept_name(p, cached_as(rules.MLA_WQ_A_OUT, z)), z.tokens(z.act * w.q_latent)
    return (
        linear(f"{a}.wq_a", rules.MLA_IN, _latent(p, z, rules.MLA_WQ_A_OUT, w.q_latent), z.weight(f"{a}.wq_a"),
               f"{g}/wq_a dx", full, p, frees=(f"{g}/dq latent",), sums=summed),
        titan.norm(f"{a}.q_norm", z, rules.MLA_Q_NORM, p, kept(p, rules.MLA_Q_UP_IN), f"{g}/dq normed",
                   f"{g}/dq latent", latent, rows=z.tokens(1), width=w.q_latent),
        linear(f"{a}.wq_b", rules.MLA_Q_UP_IN, Made(out, heads, "wq_b's output"), z.weight(f"{a}.wq_b"),
               f"{g}/dq normed", q_latent, p, frees=(f"{g}/dq up",)),
        Op(a, forward=(Step("the query latent goes (q rebound)", frees=() if z.cuda else (latent,),
                            reads_last=(kept_name(p, rules.MLA_Q_UP_IN), latent)),), backward=()),
        split,
    )


# the latent norm whose input each down projection's output is
_NORMED = {rules.MLA_WKV_A_OUT: rules.MLA_KV_NORM, rules.MLA_WQ_A_OUT: rules.MLA_Q_NORM}


def cached_as(x: SavedTensor, z: Sizes) -> SavedTensor:
    """The ledger's term the walk names SelectiveAC's cached matmul output `x` by where that output is kept as another
    term too: wkv_b's is V's storage (the ledger's MLA_KV_UP_OUT), and on CUDA wkv_a's and wq_a's are the fused latent
    norms' kept inputs."""
    if x == rules.MLA_WKV_B_OUT:
        return ledger.MLA_KV_UP_OUT
    return _NORMED[x].input if z.cuda and x in _NORMED else x


def _latent(p: str, z: Sizes, x: SavedTensor, width: int) -> Made:
    """A down projection's output (the latent, with the keys' RoPE part after wkv_a's), `width` wide, whole on every
    rank: on CUDA the fused norm's kept input, else a local of the forward (named as SelectiveAC's term)."""
    if z.cuda:
        return kept(p, _NORMED[x].input, "the latent, which the fused norm keeps")
    return Made(kept_name(p, x), z.tokens(z.act * width), "the latent, a local of the forward")


def _with_head_width(z: Sizes, d: int) -> Sizes:
    """`z` with heads of `d` channels: RoPE's table is over the d_r-wide parts."""
    return replace(z, d=d)
