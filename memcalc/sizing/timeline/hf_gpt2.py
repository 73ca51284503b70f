"""transformers' GPT2LMHeadModel described once as ops, for the hf step walk: GPT2Block (nn.LayerNorm, Conv1D's addmm
on (b*s, h) tokens, c_attn's output split into q, k and v, eager attention's softmax in the activation dtype, gelu_new
written out, the block's locals), and GPT2Model's front (learned positions added to the lookup) and its ln_f.

Its forward is walked op by op; what differs from Llama's walk: docs/timeline.md, "transformers' GPT-2".
"""

from __future__ import annotations

from dataclasses import replace

from memcalc.config.schema import ModelConfig
from memcalc.model import ledger
from memcalc.model.impls import hf as rules
from memcalc.model.ledger import NormTensors, SavedTensor
from memcalc.sizing.params import NORM_NAMES
from memcalc.sizing.timeline.hf_layer import context, rowwise, sdpa, sdpa_math
from memcalc.sizing.timeline.tape import TEMPORARIES, Sizes
from memcalc.sizing.timeline.torch_ops import WHY_WGRAD, dropout, linear
from memcalc.sizing.timeline.walk import Checkpoint, Made, Op, Step, kept, kept_names

WHY_NORM_GRADS = "the norm's weight and bias gradients, handed over as the node returns"
# GPT2Model's locals, live until it returns (ln_f has run): the lookup, the position rows, the eager mask
MODEL_LOCALS = ("model/inputs_embeds", "model/position_embeds", "model/causal_mask")
FIRST_GRAD = "grad/embedding dropout output"  # the first block's input gradient, where the embedding drops out
QKV = (ledger.Q, ledger.K, ledger.V)
# GPT-2's attention modules and norms by their names in the per-parameter inventory (memcalc.sizing.params), which
# names them as Llama's (ln_1 and ln_2 in Llama's norms' places; ln_f, LN_F, is the model's final norm, Sizes.ends);
# the MLP's are its own
INVENTORY = {"attn.c_attn": "self_attn.qkv_proj", "attn.c_proj": "self_attn.o_proj", "ln_1": NORM_NAMES["llama"][0],
             "ln_2": NORM_NAMES["llama"][2]}
LN_F = "transformer.ln_f"


def layer_norm(where: str, p: str, norm: NormTensors, z: Sizes, output: Made, dy: str, out: str,
               residual: str | None = None, gone: tuple[str, ...] = ()) -> Op:
    """nn.LayerNorm, one kernel each way. Forward: its output and each token's mean and rstd (its input, which it
    keeps too, is whoever made it); `gone`: what goes as it returns. Backward: dX, dweight and dbias (as the inventory
    holds them) beside dY, which then goes; with a `residual`, dX and the stream's gradient summed into `out` after
    the node returned (its saved tensors gone), the weights' gradients handed over after that. F.layer_norm returns
    the output alone: under a checkpoint the mean and rstd go at once."""
    g, m = "/".join(x for x in ("grad", p, where) if x), z.ends.norm if where == LN_F else INVENTORY.get(where, where)
    dw, db, dx = f"{g} weight", f"{g} bias", f"{g}/dx" if residual else out
    kernel = Step("native_layer_norm_backward: dX, dweight, dbias", (
        Made(dx, z.full(z.h), "the norm's dX"), Made(dw, z.weight(m), WHY_NORM_GRADS),
        Made(db, z.weight(m, bias=True), WHY_NORM_GRADS)), frees=(dy,), hands_over=() if residual else (dw, db),
        returns=True)
    summed = (Step("the residual's sum", (Made(out, z.full(z.h), "the residual stream's gradient: the norm's dX and"
                                               " the residual's summed"),), frees=(dx, residual), hands_over=(dw, db)),
              ) if residual else ()
    return Op(where, (Step("native_layer_norm: output, mean, rstd", (output, kept(p, norm.mean), kept(p, norm.rstd)),
                           frees=gone, reads_last=kept_names(p, norm.mean, norm.rstd)),), (kernel, *summed),
              saves=tuple(norm))


def conv1d(where: str, p: str, x: SavedTensor, gemm: Step, inputs: int, z: Sizes, dx: str,
           frees: tuple[str, ...] = (), reduced: bool = False) -> Op:
    """transformers' Conv1D: addmm(bias, x viewed (b * s, inputs), weight (inputs, outputs)), `gemm` its forward; in
    backward nn.Linear's GEMMs and its bias's sum (memcalc.sizing.timeline.torch_ops.linear), the weight's and the
    bias's gradients sized by the inventory, which says whether there is a bias (StarCoder 2's nn.Linear has one only
    with use_bias). `reduced`: a colwise nn.Linear under tp (StarCoder 2's c_fc), its dX all-reduced."""
    m = INVENTORY.get(where, where)
    bias = z.weight(m, bias=True)
    op = linear(where, x, None, z.weight(m), dx, z.full(inputs), p, frees, bias=bias, reduced=reduced)
    return replace(op, forward=(gemm,))


def block(i: int, z: Sizes, config: ModelConfig, math: bool = False) -> tuple[Op, ...]:
    """GPT2Block i, op by op (`math`: SDPA's CPU math kernel, dropout on a CPU). Its locals live to its return: the
    residual (ln_2's input, which it keeps), ln_2's output, attn_output and the attention weights it returns, the MLP's
    output; its output is the next norm's input (ln_1's, or ln_f's after the last block). Each kept tensor's last read
    in forward (`Step.reads_last`) is where it goes under a checkpoint."""
    p, g, full = f"layers.{i}", f"grad/layers.{i}", z.full(z.h)
    below = f"grad/layers.{i - 1}/output" if i else FIRST_GRAD if config.has_dropout else "grad/embedding output"
    output = Made(f"layers.{i + 1}/{ledger.LN1.input.name}" if i + 1 < config.L else ledger.FINAL_NORM.input.name,
                  full, "the block's output, the next norm's input, which it keeps")
    return (
        layer_norm("ln_1", p, ledger.LN1, z, kept(p, ledger.QKV_IN), f"{g}/ln1 output", below, f"{g}/mid"),
        *attention(p, z, config, math),
        Op("", (Step("attn_output + residual", (kept(p, ledger.LN2.input),),
                     reads_last=kept_names(p, ledger.QKV_IN)),), ()),
        layer_norm("ln_2", p, ledger.LN2, z, kept(p, ledger.FC1_IN), f"{g}/ln2 output", f"{g}/mid", f"{g}/output"),
        *mlp(p, z, config),
        Op("", (Step("the residual's sum: the block's output", (output,),
                     frees=(f"{p}/attn output", f"{p}/mlp output"),
                     reads_last=kept_names(p, ledger.LN2.input, ledger.FC1_IN, *_returned(config))),), ()),
    )


def _returned(config: ModelConfig) -> tuple[SavedTensor, ...]:
    """The attention weights eager attention returns, which the block holds to its return: softmax's output, or with
    dropout the dropped-out weights (SDPA returns none)."""
    if config.attention != "eager":
        return ()
    return (ledger.ATTN_DROPOUT_OUT,) if config.has_dropout else (ledger.SOFTMAX_OUT,)


def attention(p: str, z: Sizes, config: ModelConfig, math: bool = False) -> tuple[Op, ...]:
    """GPT2Attention: c_attn, whose (b, s, 3h) output q, k and v view; the eager core or SDPA's; c_proj (and
    resid_dropout). Eager's bmm batches (b, a) of a view only when b or a is 1: else matmul copies q, k^T and v (the
    copies are what it keeps, and c_attn's output goes as the attention returns); at b = 1 or one head, and under
    SDPA's flash kernel, the core keeps the views, c_attn's output whole (the ledger's Q, K and V, its columns) until
    QK^T's (the kernel's) backward; the `math` kernel keeps fp32 copies (in fp32 at b = 1 or one head v's view, and
    with it c_attn's output whole)."""
    g, full, h = f"grad/{p}", z.full(z.h), z.h
    eager = config.attention == "eager"
    copies = eager and z.b > 1 and z.a_t > 1
    # fp32: v's cast a no-op, bmm folds v's (b, a) as a view at b = 1 or one head, keeping c_attn's output whole
    viewed = math and z.act == 4 and (z.b == 1 or z.a_t == 1)
    why = "c_attn's output, q's, k's or v's columns: the core keeps the views, the storage whole"
    qkv = (Made(f"{p}/c_attn output", z.full(3 * h), "c_attn's (b, s, 3h) output, which q, k and v view"),) \
        if copies or math and not viewed else tuple(kept(p, x, why) for x in QKV)
    c_attn = conv1d("attn.c_attn", p, ledger.QKV_IN, Step("the GEMM", qkv), h, z, f"{g}/ln1 output",
                    (f"{g}/qkv",))
    kept_v = QKV if viewed else (rules.GPT2_MATH_V,) if z.act == 4 else (rules.MATH_V,)
    # Llama's SDPA (memcalc.sizing.timeline.hf_layer: one K/V group a head) on q, k and v as views of c_attn's output
    llama = () if eager else sdpa_math(p, z, False, f"{g}/c_proj input", "", kept_v) if math else \
        sdpa(p, z, {}, f"{g}/c_proj input")
    core = _eager(p, z, copies, config.has_dropout) if eager else tuple(replace(x, where="attn") for x in llama)
    dropped = config.has_dropout
    out = Made(f"{p}/attn output", full, "GPT2Block's attn_output, a local to its return")
    proj = Made(f"{p}/attn proj", full, "c_proj's output, resid_dropout's input") if dropped else out
    # the attention returns: q, k and v, views of c_attn's output, go (kept by the core unless under a checkpoint)
    returns = Step("", frees=tuple(x.name for x in qkv if x.keeps is None),
                   reads_last=tuple(x.name for x in qkv if x.keeps is not None))
    c_proj = conv1d("attn.c_proj", p, ledger.PROJ_IN, Step("the GEMM", (proj,), reads_last=kept_names(
        p, ledger.PROJ_IN)), h, z, f"{g}/c_proj input", (f"{g}/attn dropped",) if dropped else ())
    c_proj = replace(c_proj, forward=(*c_proj.forward, *(() if dropped else (returns,))))
    resid = (dropout("attn.resid_dropout", p, ledger.ATTN_OUT_DROPOUT_MASK, out, f"{g}/attn dropped",
                     full, gone=(proj.name,), then=returns),) if dropped else ()
    split = _split(g, z, eager or math)
    return tuple(_shadowed(x, "attn.resid_dropout", config) for x in (c_attn, split, *core, c_proj, *resid))


def _split(g: str, z: Sizes, heads: bool) -> Op:
    """The head views' backward: q's and v's (b, a, s, d) gradients (`heads`: eager's, the math kernel's) made
    (b, s, h) by a copy unless one head or one token (k's, the transposed bmm's, is a view; SDPA's flash kernel writes
    all three (b, s, a, d)); split's concatenates the three."""
    copy = heads and z.a_t > 1 and z.s > 1
    tokens = {n: f"{g}/{n} tokens" if copy and n != "k" else f"{g}/{n} heads" for n in "qkv"}
    return Op("attn", (), (
        *(Step(f"{n}'s gradient made (b, s, h)", (Made(tokens[n], z.full(z.h), "the head view's backward: a"
                                                     " copy"),), frees=(f"{g}/{n} heads",), moment=False)
          for n in "vq" if copy),
        Step("split's backward: the three gradients concatenated", (Made(f"{g}/qkv", z.full(3 * z.h), "c_attn's"
                                                                          " output gradient, (b, s, 3h)"),),
             frees=tuple(tokens.values())),
    ))


def _eager(p: str, z: Sizes, copies: bool, dropped: bool) -> tuple[Op, ...]:
    """eager_attention_forward (GPT-2's): QK^T times the scale, plus the mask, softmax in the activation dtype,
    (`dropped`: dropout on the weights,) weights x V, the context made (b, s, h). Without `copies` bmm keeps the views
    of c_attn's output: Q, K and V go together, at QK^T's backward."""
    g, q = f"grad/{p}", z.full(z.h)
    sc, x = z.act * z.b * z.a_t * z.s * z.s, f"{p}/scores"
    heads = copies and z.s > 1  # dY (b, s, a, d) folds into a (b * a) batch as a view only when b, a or s is 1
    dy = f"{g}/attn heads" if heads else f"{g}/c_proj input"
    weights = ledger.ATTN_DROPOUT_OUT if dropped else ledger.SOFTMAX_OUT
    dweights = f"{g}/dropped" if dropped else f"{g}/weights"
    drop = (dropout("attn", p, ledger.ATTN_DROPOUT_MASK, kept(p, ledger.ATTN_DROPOUT_OUT), f"{g}/weights",
                    sc, frees=(dweights,), reads=kept_names(p, ledger.SOFTMAX_OUT)),) if dropped else ()
    return (
        Op("attn", (
            *(Step(f"{n} copied for bmm", (kept(p, t),)) for n, t in (("q", ledger.Q), ("k^T", ledger.K)) if copies),
            Step("QK^T", (Made(x, sc, "bmm's output"),), reads_last=kept_names(p, ledger.Q, ledger.K) if copies
                 else ()),
            Step("times the scale", (Made(f"{x} scaled", sc, "a temporary"),), frees=(x,)),
        ), (
            Step("QK^T's backward: dQ and dK", (Made(f"{g}/q heads", q, "dQ = dScores K"), Made(
                f"{g}/k heads", q, "dK = dScores^T Q")), frees=(f"{g}/scaled scores",)),
        ), saves=(ledger.Q, ledger.K) if copies else QKV),
        Op("attn", (
            Step("plus the mask", (Made(f"{x} masked", sc, "a temporary"),), frees=(f"{x} scaled",)),
            Step("softmax", (kept(p, ledger.SOFTMAX_OUT),), frees=(f"{x} masked",)),
        ), (
            Step("softmax's backward", (Made(f"{g}/scores", sc, "softmax's backward"),), frees=(f"{g}/weights",),
                 returns=True),
            Step("the scale's backward", (Made(f"{g}/scaled scores", sc, "dY * scale"),), frees=(f"{g}/scores",)),
        ), saves=(ledger.SOFTMAX_OUT,)),
        *drop,
        Op("attn", (
            *((Step("v copied for bmm", (kept(p, ledger.V),)),) if copies else ()),
            *context(p, z, q, kept_names(p, ledger.V) if copies else (), ()),
        ), (
            *((Step("the context's gradient made (b, a, s, d)", (Made(dy, q, "contiguous for bmm"),),
                    frees=(f"{g}/c_proj input",), moment=False),) if heads else ()),
            Step("weights x V's backward: dV and dWeights", (Made(f"{g}/v heads", q, "dV = weights^T dY"), Made(
                dweights, sc, "dWeights = dY V^T")), frees=(dy,)),
        ), saves=(weights, ledger.V)),
    )


def mlp(p: str, z: Sizes, config: ModelConfig, drop: str | None = "mlp.dropout", tp: bool = False) -> tuple[Op, ...]:
    """GPT2MLP: c_fc, the activation (gelu_new written out, or torch's GELU), c_proj, its `drop` module (None:
    F.dropout inside the MLP's forward, StarCoder 2's: no module MemTracker reads c_proj's backward in; `tp`: its
    c_fc colwise, c_proj rowwise)."""
    g, full, f = f"grad/{p}", z.full(z.h), z.f_t
    c_fc = conv1d("mlp.c_fc", p, ledger.FC1_IN, Step("the GEMM", (kept(p, ledger.GELU_IN),)), z.h, z,
                  f"{g}/ln2 output", (f"{g}/gelu_in",), reduced=tp)
    act = _gelu_new(p, z) if config.mlp == "gelu_tanh" else (Op("mlp.act", (
        Step("GELU", (kept(p, ledger.FC2_IN),), reads_last=kept_names(p, ledger.GELU_IN)),), (
        Step("GELU's backward", (Made(f"{g}/gelu_in", z.full(f), "dY * GELU'(x)"),), frees=(f"{g}/act output",)),),
        saves=(ledger.GELU_IN,)),)
    dropped = config.has_dropout
    out = Made(f"{p}/mlp output", full, "the MLP's output, a local of the block to its return")
    proj = Made(f"{p}/mlp proj", full, "c_proj's output, the dropout's input") if dropped else out
    c_proj = conv1d("mlp.c_proj", p, ledger.FC2_IN, rowwise(Step("the GEMM", (proj,), reads_last=kept_names(
        p, ledger.FC2_IN)), f"{p}/mlp partial", tp), f, z, f"{g}/act output",
                    (f"{g}/mlp dropped",) if dropped else ())
    resid = (dropout(drop or "mlp", p, ledger.MLP_DROPOUT_MASK, out, f"{g}/mlp dropped", full,
                     gone=(proj.name,)),) if dropped else ()
    return (c_fc, *act, _shadowed(c_proj, drop, config) if drop else c_proj, *resid)


def _gelu_new(p: str, z: Sizes) -> tuple[Op, ...]:
    """NewGELUActivation: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), each product and sum a new
    (b, s, f) tensor; in backward x's three gradients (the sum's, pow's, 0.5 * x's) are summed as they come."""
    n, g, f = f"{p}/mlp.act", f"grad/{p}/mlp.act", z.full(z.f_t)

    def local(name: str) -> Made:  # a temporary of the expression, forward's or a backward formula's
        return Made(f"{n}/{name}", f, "a temporary")

    def grad(name: str, why: str) -> Made:
        return Made(f"{g}/{name}", f, why)

    return (
        Op("mlp.act", (Step("0.5 * x", (kept(p, rules.HALF_X),)),), (
            Step("0.5 * x's backward", (grad("dx (half)", "0.5 * dY"),), frees=(f"{g}/dhalf_x",)),
            Step("autograd sums x's gradients", (Made(f"grad/{p}/gelu_in", f, "x's gradient: its three uses'"
                                                     " summed"),), frees=(f"{g}/dx (sum)", f"{g}/dx (half)")),
        )),
        Op("mlp.act", (Step("pow(x, 3)", (local("x^3"),)),), (
            Step("pow's backward: 3 x^2 dY", (local("x^2"), local("3x^2"), grad("dx (pow)", "dY * 3x^2")),
                 frees=(f"{n}/x^2", f"{n}/3x^2", f"{g}/dx^3"), returns=True),
            Step("autograd sums x's gradients", (grad("dx (sum)", "the sum's and pow's summed"),),
                 frees=(f"{g}/dinner", f"{g}/dx (pow)")),
        ), saves=(ledger.GELU_IN,)),
        Op("mlp.act", (Step("0.044715 * x^3", (local("cubic"),), frees=(f"{n}/x^3",)),), (
            Step("0.044715 * (.)'s backward", (grad("dx^3", "0.044715 * dY"),)),)),
        Op("mlp.act", (Step("x + 0.044715 x^3", (local("inner"),), frees=(f"{n}/cubic",)),), ()),
        Op("mlp.act", (Step("sqrt(2/pi) * (.)", (local("tanh input"),), frees=(f"{n}/inner",)),), (
            Step("sqrt(2/pi) * (.)'s backward", (grad("dinner", "sqrt(2/pi) * dY"),), frees=(f"{g}/dtanh input",)),)),
        Op("mlp.act", (Step("tanh", (kept(p, rules.TANH_OUT),), frees=(f"{n}/tanh input",)),), (
            Step("tanh's backward", (grad("dtanh input", "dY * (1 - tanh^2)"),), frees=(f"{g}/done_plus_tanh",)),),
           saves=(rules.TANH_OUT,)),
        Op("mlp.act", (Step("1 + tanh", (kept(p, rules.ONE_PLUS_TANH),), reads_last=kept_names(p, rules.TANH_OUT)),),
           ()),
        Op("mlp.act", (Step("0.5x * (1 + tanh): the activation", (kept(p, ledger.FC2_IN),),
                            reads_last=kept_names(p, ledger.GELU_IN, rules.HALF_X, rules.ONE_PLUS_TANH)),), (
            Step("the product's backward", (grad("dhalf_x", "dY * (1 + tanh)"), grad("done_plus_tanh", "dY * 0.5x")),
                 frees=(f"grad/{p}/act output",)),), saves=(rules.HALF_X, rules.ONE_PLUS_TANH)),
    )


def _shadowed(op: Op, dropout: str, config: ModelConfig) -> Op:
    """Without dropout nn.Dropout returns its input: MemTracker reads the backward of the ops before it (but those
    that make outputs of their own: c_attn) inside the dropout module, which returns their output as its own."""
    if config.has_dropout or op.where == "attn.c_attn":
        return op
    return Op(op.where, op.forward, op.backward, op.saves, shadow=dropout)


def embedding(z: Sizes, config: ModelConfig, lookup_backward: tuple[Step, ...]) -> tuple[Op, ...]:
    """GPT2Model's front: wte's lookup, the position ids, wpe's lookup, their sum (the first block's input), the
    eager mask. In backward the positions' gradient (summed over the batch when b > 1, else the sum's gradient
    itself) goes into wpe's table, then the lookup's (`lookup_backward`, Llama's) into wte's."""
    positions = z.act * z.s * z.h
    summed = "grad/position embeds" if z.b > 1 else "grad/embedding output"
    first = Made(f"layers.0/{ledger.LN1.input.name}", z.full(z.h), "the first block's input, which its ln_1 keeps")
    dropped = config.has_dropout
    embeds = Made("model/embeds", z.full(z.h), "inputs_embeds + position_embeds, the dropout's input") if dropped \
        else first
    mask = (Step("create_causal_mask", (Made("model/causal_mask", z.act * z.b * z.s * z.s, "the additive (b, 1, s, s)"
                                             " mask, live until GPT2Model returns"),), moment=False),
            ) if config.attention == "eager" else ()
    add = Op("transformer", (Step("inputs_embeds + position_embeds", (embeds,)), *mask), (Step(
        "the positions' gradient summed over the batch", (Made(summed, positions, "sum_to (1, s, h)"),)),
        ) if z.b > 1 else ())
    return (
        Op("transformer.wte", (Step("the token lookup", (Made(MODEL_LOCALS[0], z.full(z.h), "wte's lookup:"
                                                              " inputs_embeds, live until GPT2Model returns"),)),),
           lookup_backward),
        Op("transformer", (
            Step("arange(s)", (Made("model/arange", 8 * z.s, "int64"),), moment=False),
            Step("+ past_seen_tokens: the position ids", (Made("model/position_ids", 8 * z.s, "int64 (1, s); wpe's"
                                                               " backward keeps them"),), frees=("model/arange",),
                 moment=False)), ()),
        Op("transformer.wpe", (Step("the position lookup", (Made(MODEL_LOCALS[1], positions, "wpe's (1, s, h) rows,"
                                                                 " live until GPT2Model returns"),)),), (
            Step("the position table's gradient", (Made("grad/wpe weight", z.weight(z.ends.position), WHY_WGRAD),),
                 frees=((summed,) if z.b > 1 else ()) + ("model/position_ids",), hands_over=("grad/wpe weight",)),)),
        _shadowed(add, "transformer.drop", config),
        *((dropout("transformer.drop", "", ledger.EMBEDDING_DROPOUT_MASK, first, "grad/embedding output",
                   z.full(z.h), gone=(embeds.name,), frees=(FIRST_GRAD,)),) if dropped else ()),
    )


def final_norm(z: Sizes, config: ModelConfig) -> Op:
    """ln_f: its output is lm_head's input; GPT2Model's locals go as it returns (the mask, under a checkpoint, when
    the first block's frame lets it go)."""
    gone = MODEL_LOCALS[:2] if config.recompute == "full" else MODEL_LOCALS
    return layer_norm(LN_F, "", ledger.FINAL_NORM, z, kept("", ledger.OUTPUT_INPUT),
                      "grad/lm_head input", f"grad/layers.{config.L - 1}/output", gone=gone)


def checkpoint(i: int, config: ModelConfig) -> Checkpoint | None:
    """gradient_checkpointing_enable's non-reentrant checkpoint around block i's forward (GradientCheckpointingLayer,
    early stop on): its frame holds the block's input and the mask GPT2Model passes, which the first block's frame is
    the last to let go (the position ids wpe keeps anyway). The block's own ops, its residual sums, rerun outside any
    module's forward: MemTracker's temporaries."""
    if config.recompute != "full":
        return None
    mask = ("model/causal_mask",) if i == 0 and config.attention == "eager" else ()
    return Checkpoint(f"layers.{i}/{ledger.LN1.input.name}", early_stop=True, own=TEMPORARIES, frame=mask)


def ends(z: Sizes, saved: dict[str, int]) -> dict[str, int]:
    """The bytes of what the model's ends keep: ln_f's tensors are a block's ln_1's sizes; lm_head's input; the
    embedding dropout's mask is a block's MLP dropout's."""
    norm = {y.name: saved[x.name] for x, y in zip(ledger.LN1, ledger.FINAL_NORM)}
    mask = {ledger.EMBEDDING_DROPOUT_MASK.name: saved[ledger.MLP_DROPOUT_MASK.name]} \
        if ledger.MLP_DROPOUT_MASK.name in saved else {}
    return norm | mask | {ledger.OUTPUT_INPUT.name: z.full(z.h)}
