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
from memcalc.sizing.timeline.megatron_mla import Widths
from memcalc.sizing.timeline.tape import Sizes
from memcalc.sizing.timeline.torch_ops import linear
from memcalc.sizing.timeline.torchtitan_ops import (
    attention_kernel, first_residual, gather, norm, norm_out, pre_norm, reduce_scatter, rope_ops,
)
from memcalc.sizing.timeline.walk import Made, Op, Step, kept, kept_name, kept_names

A = "attention"  # the Attention module's path below the block's


def latent_attention_ops(p: str, z: Sizes, config: ModelConfig, mid: str, gmid: str, gx: str,
                         h: int) -> tuple[Op, ...]:
    """attention_norm, the Attention (the query projection, wkv_a, RoPE on the d_r-wide parts, kv_norm, wkv_b, the two
    concatenations, SDPA, wo) and the first residual sum, in forward order; their backward is the reverse, as
    autograd runs it (the later-made node first among those ready: the key/value path before the query's). Each
    tensor's width is its own (`Widths`): the values' d_v apart from the heads' d_n + d_r."""
    w, g = Widths.of(config), f"grad/{p}/{A}"
    entry = norm_out(z, p, "attention_norm", rules.MLA_IN)
    return (
        *pre_norm("attention_norm", z, rules.LN1, p, entry, f"grad/{p}/attention_norm dy" if z.t > 1 else f"{g}/dx",
                  f"{p}/input", gmid, gx),
        *gather(A, z, p, kept(p, rules.MLA_IN), f"{g}/dx", f"grad/{p}/attention_norm dy"),
        *_query_ops(p, z, w),
        *_key_value_ops(p, z, w),
        *_core_ops(p, z, w),
        first_residual(p, z, mid, h, kept_name(p, rules.WO_OUT) if z.t == 1 else f"{p}/attention out"),
    )


def _query_ops(p: str, z: Sizes, w: Widths) -> tuple[Op, ...]:
    """The query projection: wq on x, or wq_a, q_norm and wq_b (a/t heads of d_n + d_r, of which q_nope and q_pe are
    views); in backward the split's d[q_nope | q_pe] concatenated first (read in wkv_a, whose node ran before it), x's
    gradient summed with wkv_a's. ModTracker's multi-grad hook on RoPE's inputs holds k's gradient until this split's
    node starts."""
    g, full, heads = f"grad/{p}/{A}", z.full(z.h), z.tokens(z.act * z.a_t * w.qk)
    split = Op(A, forward=(), backward=(
        Step("RoPE's hook lets k's dY go", frees=(f"{g}/dk pre-rope",)),
        Step("the split's backward: d[q_nope | q_pe] concatenated", (
            Made(f"{g}/dq up", heads, "the query projection's output's gradient"),),
            frees=(f"{g}/dq", f"{g}/dq pre-rope"))), shadow=f"{A}.wkv_a")
    summed = (f"{g}/wkv_a dx", f"{g}/dx", full)
    if w.q_latent is None:
        return (linear(f"{A}.wq", rules.MLA_IN, Made(_query_output(p, w), heads, "wq's output"), z.weight(f"{A}.wq"),
                       f"{g}/wq dx", full, p, frees=(f"{g}/dq up",), sums=summed), split)
    latent = kept_name(p, cached_as(rules.MLA_WQ_A_OUT, z))
    return (
        linear(f"{A}.wq_a", rules.MLA_IN, _latent(p, z, rules.MLA_WQ_A_OUT, w.q_latent), z.weight(f"{A}.wq_a"),
               f"{g}/wq_a dx", full, p, frees=(f"{g}/dq latent",), sums=summed),
        norm(f"{A}.q_norm", z, rules.MLA_Q_NORM, p, kept(p, rules.MLA_Q_UP_IN), f"{g}/dq normed", f"{g}/dq latent",
             latent, rows=z.tokens(1), width=w.q_latent),
        linear(f"{A}.wq_b", rules.MLA_Q_UP_IN, Made(_query_output(p, w), heads, "wq_b's output"),
               z.weight(f"{A}.wq_b"), f"{g}/dq normed", z.tokens(z.act * w.q_latent), p, frees=(f"{g}/dq up",)),
        _rebound(p, z, "the query latent goes (q rebound)", latent, rules.MLA_Q_UP_IN),
        split,
    )


def _key_value_ops(p: str, z: Sizes, w: Widths) -> tuple[Op, ...]:
    """wkv_a, RoPE on q_pe and k_pe, Q's concatenation, kv_norm, wkv_b (kept whole in V's place) and K's
    concatenation. In backward K's concatenation and the split of wkv_b's output are read in inner_attention (its
    hook waits for Q's gradient); the expand of k_pe over the heads sums dK's RoPE part, but over one head it is a view
    of dK, which then lives until RoPE's backward of k has read it. As Q's concatenation starts, the hook lets dK and
    dV go."""
    g, latent = f"grad/{p}/{A}", kept_name(p, cached_as(rules.MLA_WKV_A_OUT, z))
    expanded = z.a_t > 1
    k_grad = f"{g}/dk_pe" if expanded else f"{g}/dk"
    expand = (Step("the expand's backward: dk_pe summed over the heads", (
        Made(k_grad, z.tokens(z.act * w.rope), "k_pe's gradient"),)),) if expanded else ()
    q_pe, k_pe = z.tokens(z.act * z.a_t * w.rope), z.tokens(z.act * w.rope)
    return (
        linear(f"{A}.wkv_a", rules.MLA_IN, _latent(p, z, rules.MLA_WKV_A_OUT, w.kv_latent + w.rope),
               z.weight(f"{A}.wkv_a"), f"{g}/wkv_a dx", z.full(z.h), p, frees=(f"{g}/dkv_a",)),
        Op(A, forward=(), backward=(Step("the split's backward: d[latent | k_pe] concatenated", (
            Made(f"{g}/dkv_a", z.tokens(z.act * (w.kv_latent + w.rope)), "wkv_a's output's gradient"),),
            frees=(f"{g}/dkv latent",)),), shadow=f"{A}.rope"),
        # RoPE's table is over each head's d_r RoPE channels; its outputs are the forward's locals
        rope_ops(p, replace(z, d=w.rope), q_pe, k_pe, k_grad=k_grad, table=rules.MLA_ROPE_CACHE, outputs=(
            Made(f"{p}/q_pe", q_pe, "RoPE(q_pe), a local"), Made(f"{p}/k_pe", k_pe, "RoPE(k_pe), a local"))),
        Op(A, forward=(Step("q = cat(q_nope, q_pe)", (kept(p, ledger.MLA_Q),)),), backward=(
            Step("the hook on SDPA's inputs lets dK and dV go",
                 frees=(f"{g}/dk", f"{g}/dv") if expanded else (f"{g}/dv",)),)),
        norm(f"{A}.kv_norm", z, rules.MLA_KV_NORM, p, kept(p, rules.MLA_KV_UP_IN), f"{g}/dkv normed",
             f"{g}/dkv latent", latent, rows=z.tokens(1), width=w.kv_latent),
        linear(f"{A}.wkv_b", rules.MLA_KV_UP_IN, kept(p, ledger.MLA_KV_UP_OUT), z.weight(f"{A}.wkv_b"),
               f"{g}/dkv normed", z.tokens(z.act * w.kv_latent), p, frees=(f"{g}/dkv up",)),
        _rebound(p, z, "wkv_a's output goes (kv rebound)", latent, rules.MLA_KV_UP_IN),
        Op(A, forward=(Step("k = cat(k_nope, k_pe expanded)", (kept(p, ledger.MLA_K),)),), backward=(
            *expand, Step("the split's backward: d[k_nope | v] concatenated", (
                Made(f"{g}/dkv up", z.tokens(z.act * z.a_t * (w.nope + w.v)), "wkv_b's output's gradient"),))),
           shadow=f"{A}.inner_attention"),
    )


def _core_ops(p: str, z: Sizes, w: Widths) -> tuple[Op, ...]:
    """The attention kernel (V: wkv_b's whole output), wo and under tp its collectives; then the Attention returns
    and its locals go (the query projection's output, RoPE's outputs)."""
    g, full = f"grad/{p}/{A}", z.full(z.h)
    wo_out, dy = kept_name(p, rules.WO_OUT), f"{g}/dY whole"  # its partial sum under tp; its dY gathered under SP
    qk, v = z.tokens(z.act * z.a_t * w.qk), z.tokens(z.act * z.a_t * w.v)
    return (
        attention_kernel(p, z, (qk, qk, v), (ledger.MLA_Q, ledger.MLA_K, ledger.MLA_KV_UP_OUT), ledger.MLA_PROJ_IN),
        linear(f"{A}.wo", ledger.MLA_PROJ_IN, Made(wo_out, full, "wo's output"), z.weight(f"{A}.wo"), f"{g}/dout", v,
               p, frees=(dy,) if z.sp else ()),
        *reduce_scatter(f"{A}.wo", z, p, wo_out, f"{p}/attention out", dy, ()),
        Op(A, forward=(Step("the Attention returns: its locals go", frees=(
            _query_output(p, w), f"{p}/q_pe", f"{p}/k_pe",
            *((f"{p}/attention_norm out",) if z.sp else ())), reads_last=kept_names(
            p, rules.MLA_IN, ledger.MLA_Q, ledger.MLA_K, ledger.MLA_KV_UP_OUT, ledger.MLA_PROJ_IN)),), backward=()),
    )


def _query_output(p: str, w: Widths) -> str:
    """The name of the query projection's output (wq's, SelectiveAC's term for it, or wq_b's)."""
    return kept_name(p, rules.MLA_WQ_OUT) if w.q_latent is None else f"{p}/wq_b out"


def _rebound(p: str, z: Sizes, what: str, latent: str, normed: SavedTensor) -> Op:
    """A down projection's output goes as its name is rebound to the up projection's (on CUDA the fused norm keeps
    it); the norm's output (`normed`, the up projection's kept input) is read last there."""
    return Op(A, forward=(Step(what, frees=() if z.cuda else (latent,), reads_last=(kept_name(p, normed), latent)),),
              backward=())


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
