"""transformers' DeepseekV3Attention (DeepSeek-V2/V3's multi-head latent attention, eager) as ops for the hf step walk.

Llama's eager core (memcalc.sizing.timeline.hf_layer) over query and key heads of d_n + d_r channels and values of d_v,
between the latents' down and up projections, their RMSNorms, RoPE's interleaved halves and expand_kv's copies into
the keys: docs/timeline.md, "transformers' latent attention".
"""

from __future__ import annotations

from dataclasses import replace

from memcalc.config.schema import ModelConfig
from memcalc.model import ledger
from memcalc.model.impls import hf as rules
from memcalc.model.ledger import SavedTensor
from memcalc.sizing.timeline import hf_layer as layer
from memcalc.sizing.timeline.tape import Sizes
from memcalc.sizing.timeline.torch_ops import linear
from memcalc.sizing.timeline.walk import Made, Op, Step, kept

TABLES = (rules.MLA_ROPE_COS, rules.MLA_ROPE_SIN)  # the model's (s, d_r) tables, which every layer keeps
# the ledger's records of Llama's core and the latent attention's: q and k of d_n + d_r channels, V of d_v
_CORE = {ledger.Q: ledger.MLA_Q, ledger.K: ledger.MLA_K}


def attention(p: str, z: Sizes, config: ModelConfig, saved: dict[str, int]) -> tuple[Op, ...]:
    """The attention's ops in forward order (their backward as autograd runs it): the query's down projection, norm and
    up projection (or q_proj), the key/value latent's, RoPE, expand_kv's copies, Llama's eager core, o_proj; its
    input's gradient is `grad/{p}/ln1 output`."""
    g, a = f"grad/{p}", z.a_t
    dn, dr, dv = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    dq, kvr, full = dn + dr, config.kv_lora_rank, z.full(z.h)
    heads = a > 1 and z.s > 1  # a (b, a, s, x) view of a (b, s, a, x) output: reshaped back by a copy
    return (
        *_query(p, z, config, dq, heads),
        linear("self_attn.kv_a_proj_with_mqa", ledger.QKV_IN, None, z.weight("self_attn.kv_a_proj_with_mqa"),
               f"{g}/kv_a input", full, p, (f"{g}/kv latent",)),
        Op("self_attn", (), (Step("split's backward: the latent's and k_rot's gradients concatenated", (
            Made(f"{g}/kv latent", z.full(kvr + dr), "(b, s, r_kv + d_r)"),), frees=(f"{g}/kv norm input",
                                                                                  f"{g}/k rot"), moment=False),)),
        *layer.rms_norm("self_attn.kv_a_layernorm", p, rules.MLA_KV_RMS, z, f"{g}/kv_b_proj input",
                        f"{g}/kv norm input", width=kvr),
        *_rope(g, z, a, dr, p == "layers.0"),
        linear("self_attn.kv_b_proj", ledger.MLA_KV_UP_IN, None, z.weight("self_attn.kv_b_proj"),
               f"{g}/kv_b_proj input", z.full(kvr), p, (f"{g}/kv up tokens" if heads else f"{g}/kv up heads",)),
        Op("self_attn", (), (
            Step("split's backward: k_nope's and V's gradients concatenated", (Made(
                f"{g}/kv up heads", z.full(a * (dn + dv)), "(b, a, s, d_n + d_v)"),), frees=(f"{g}/k nope",
                                                                                           f"{g}/v heads")),
            *((Step("the heads' view's backward: made (b, s, a (d_n + d_v))", (Made(
                f"{g}/kv up tokens", z.full(a * (dn + dv)), "a contiguous copy"),), frees=(f"{g}/kv up heads",)),)
              if heads else ()))),
        *_key_copies(g, z, dn, dr),
        *_core(p, z, config, saved, dq, dv),
        linear("self_attn.o_proj", ledger.MLA_PROJ_IN, None, z.weight("self_attn.o_proj"), f"{g}/o_proj input",
               z.full(a * dv), p),
    )


def _query(p: str, z: Sizes, config: ModelConfig, dq: int, heads: bool) -> tuple[Op, ...]:
    """q_a_proj, q_a_layernorm and q_b_proj (q_proj without a query latent; its dX summed with kv_a_proj's into the
    attention input's), then the heads' view and split, whose backward concatenates dQ's two parts (read while
    kv_a_proj_with_mqa, whose backward ran just before, is MemTracker's module)."""
    g, full, qr = f"grad/{p}", z.full(z.h), config.q_lora_rank
    summed = (f"{g}/kv_a input", f"{g}/ln1 output", full)
    q_tokens = f"{g}/q tokens" if heads else f"{g}/q split"
    split = Op("self_attn", (), (
        Step("split's backward: q_pass's and q_rot's gradients concatenated", (Made(
            f"{g}/q split", z.full(z.a_t * dq), "(b, a, s, d_n + d_r)"),), frees=(f"{g}/q heads", f"{g}/q rot")),
        *((Step("the heads' view's backward: made (b, s, a (d_n + d_r))", (Made(
            q_tokens, z.full(z.a_t * dq), "a contiguous copy"),), frees=(f"{g}/q split",)),) if heads else ())),
        shadow="self_attn.kv_a_proj_with_mqa")
    if qr is None:
        return (linear("self_attn.q_proj", ledger.QKV_IN, None, z.weight("self_attn.q_proj"), f"{g}/q_proj input", full,
                       p, (q_tokens,), sums=summed), split)
    return (
        linear("self_attn.q_a_proj", ledger.QKV_IN, None, z.weight("self_attn.q_a_proj"), f"{g}/q_a_proj input",
               full, p, (f"{g}/q latent",), sums=summed),
        *layer.rms_norm("self_attn.q_a_layernorm", p, rules.MLA_Q_RMS, z, f"{g}/q_b_proj input", f"{g}/q latent",
                        width=qr),
        linear("self_attn.q_b_proj", ledger.MLA_Q_UP_IN, None, z.weight("self_attn.q_b_proj"), f"{g}/q_b_proj input",
               z.full(qr), p, (q_tokens,)),
        split,
    )


def _rope(g: str, z: Sizes, a: int, dr: int, first: bool) -> tuple[Op, ...]:
    """apply_rotary_pos_emb_interleave's backward, read while kv_b_proj is MemTracker's module: q's and k's rotations
    undone (x1 cos - x2 sin, x2 cos + x1 sin: each half's gradient), k's first; then, the slices' nodes being older,
    each half's gradient placed at its even or odd channels in a zero tensor and the two summed, k's first; the last
    to run it (layers.0, q) frees the model's tables as its rotation's products return."""
    widths = {"q": z.full(a * dr), "k": z.full(dr)}

    def rotation(name: str) -> Op:
        x = f"{g}/{name} rot"
        tables = tuple(t.name for t in TABLES) if first and name == "q" else ()
        return Op("self_attn", (), (Step("the rotation's backward: each half's gradient", (Made(
            f"{x} halves", widths[name], "dx1 and dx2, half wide each"),), frees=(f"{x} rotated", *tables),
            moment=False),), shadow="self_attn.kv_b_proj")

    def placement(name: str) -> Op:
        x, width = f"{g}/{name} rot", widths[name]
        return Op("self_attn", (), (
            Step("each half placed at its channels", (Made(f"{x} even", width, "slice's backward: a zero tensor"),
                                                      Made(f"{x} odd", width, "slice's backward: a zero tensor")),
                 frees=(f"{x} halves",), moment=False),
            Step("the halves' gradients summed", (Made(x, width, "the rotated part's gradient"),),
                 frees=(f"{x} even", f"{x} odd"))), shadow="self_attn.kv_b_proj")
    return (placement("q"), placement("k"), rotation("q"), rotation("k"))


def _key_copies(g: str, z: Sizes, dn: int, dr: int) -> tuple[Op, ...]:
    """expand_kv's keys: k_rot expanded to every head, then new_empty's (b, a, s, d_n + d_r) keys with k_nope and k_rot
    copied in; in backward each copy_ is CopySlices (dK copied whole, the slice cloned; the later copy's destination
    needs its gradient: the slice zeroed in it), then the expand's sum over the heads."""
    a, keys = z.a_t, z.full(z.a_t * (dn + dr))
    return (
        Op("self_attn", (), (Step("the expand's backward: k_rot's gradient summed over the heads", (Made(
            f"{g}/k rot rotated", z.full(dr), "(b, 1, s, d_r)"),), frees=(f"{g}/k rot heads",), moment=False),)),
        Op("self_attn", (), (Step("copy_(k_nope)'s backward: dK copied, k_nope's slice cloned", (
            Made(f"{g}/k copied again", keys, "CopySlices' copy of the keys' gradient"),
            Made(f"{g}/k nope", z.full(a * dn), "the slice's gradient")),
            frees=(f"{g}/k copied", f"{g}/k copied again")),)),
        Op("self_attn", (), (Step("copy_(k_rot)'s backward: dK copied, k_rot's slice cloned and zeroed in it", (
            Made(f"{g}/k copied", keys, "CopySlices' copy of the keys' gradient"),
            Made(f"{g}/k rot heads", z.full(a * dr), "the slice's gradient"),
            Made(f"{g}/k zeros", z.full(a * dr), "zeros_like: the earlier copy's destination's gradient")),
            frees=(f"{g}/k heads", f"{g}/k zeros")),)),
    )


def _core(p: str, z: Sizes, config: ModelConfig, saved: dict[str, int], dq: int, dv: int) -> tuple[Op, ...]:
    """Llama's eager core (hf_layer), QK^T over heads of d_q channels and weights x V over d_v ones, keeping the
    latent attention's records; no repeat_kv (a head a K/V group)."""
    # what the core keeps as V: matmul's copy, or the up projection's whole output where V stays a view of it
    records = _CORE | {ledger.V: ledger.MLA_V if ledger.MLA_V.name in saved else ledger.MLA_KV_UP_OUT}
    narrow = {n: layer.eager_core(p, replace(z, d=d), saved, False, config.has_dropout)
              for n, d in (("q", dq), ("v", dv))}
    _, qk, *rest = narrow["q"]
    *_, context = narrow["v"]
    return tuple(replace(x, saves=tuple(records.get(t, t) for t in x.saves)) for x in (qk, *rest[:-1], context))


def eager_forward(p: str, z: Sizes, config: ModelConfig, saved: dict[str, int]
                  ) -> tuple[tuple[Op, ...], frozenset[SavedTensor]]:
    """The core's two forward moments: its fp32 softmax (Llama's, hf_layer.core_forward: the masked scores and their
    fp32 cast beside the softmax), then o_proj's input made (b, s, a, d_v) beside bmm's output, each with the
    attention's locals (q_b_proj's (q_proj's) output, which q_pass views; kv_a_proj_with_mqa's, which compressed_kv
    holds; RoPE's q_rot and k_rot; kv_b_proj's output where V is matmul's copy) and the kept tensors made by then; the
    second makes those after the softmax (the weights cast back, dropout's, V's copy, o_proj's input), wide values'
    moment."""
    a, dn, dr, dv = z.a_t, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    sc, cast = z.act * z.b * a * z.s * z.s, z.act != 4
    copied = ledger.MLA_V.name in saved
    locals_ = (
        Made(f"{p}/q states", z.full(a * (dn + dr)), "the query's up projection, q_pass a view of it"),
        # in fp32 the kv norm keeps it whole (its no-op cast's input is a view of it: the ledger's MLA_KV_NORM_VIEW)
        *((Made(f"{p}/compressed kv", z.full(config.kv_lora_rank + dr), "kv_a_proj_with_mqa's output"),)
          if cast else ()),
        Made(f"{p}/q rot", z.full(a * dr), "RoPE's q_rot"), Made(f"{p}/k rot", z.full(dr), "RoPE's k_rot"),
        *((Made(f"{p}/kv up", z.full(a * (dn + dv)), "kv_b_proj's output, V a view of it"),) if copied else ()),
    )
    scores = (Made(f"{p}/scores masked", sc, "the scores plus the mask, a local the softmax rebinds"),
              *((Made(f"{p}/scores fp32", 2 * sc, "softmax's input cast to fp32, a temporary"),) if cast else ()))
    later = (*((rules.WEIGHTS,) if rules.WEIGHTS.name in saved else ()),
             *((ledger.ATTN_DROPOUT_MASK, ledger.ATTN_DROPOUT_OUT) if config.has_dropout else ()),
             *((ledger.MLA_V,) if copied else ()))
    context = () if z.s == 1 or a == 1 else (Made(f"{p}/context", z.full(a * dv), "bmm's (b, a, s, d_v) output"),)
    made = (*(kept(p, x) for x in (*later, ledger.MLA_PROJ_IN)), *context)
    return (Op("self_attn", (
        Step("the fp32 softmax", (*locals_, *scores), frees=tuple(x.name for x in scores)),
        Step("weights x V, made (b, s, a, d_v)", made, frees=tuple(x.name for x in (*context, *locals_))),
    ), ()),), frozenset(later)
