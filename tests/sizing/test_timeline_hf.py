"""The step timeline of transformers' LlamaForCausalLM (`--impl hf`) as a model: each layer adds the hf ledger's
saved tensors less the RoPE tables every layer shares, the model states count transformers' unpadded vocabulary
and RoPE's two fp32 buffers, backward leaves only the batch and the loss behind, and what it does not walk is
refused by name. Against MemTracker: tests/probe/libs/test_hf_step.py."""

import pytest

from memcalc.config.schema import build_config
from memcalc.errors import ConfigError
from memcalc.model.evaluate import estimate
from memcalc.model.impls import hf as rules
from memcalc.model.knobs import Accounting
from memcalc.model.strategy import STRATEGIES
from memcalc.sizing.states import total_params
from memcalc.sizing.timeline import ACTIVATIONS, PARAMETERS, TEMPORARIES, timeline
from memcalc.sizing.timeline.hf_layer import widest
from memcalc.sizing.timeline.walk import Made, Op, Step
from tests.helpers import LLAMA_HF

LLAMA = LLAMA_HF | {"L": 3}
CPU = Accounting(exact=True, device="cpu")
NONE, TP = STRATEGIES["none"], STRATEGIES["tp"]


def _timeline(strategy=NONE, **changes):
    config = build_config(LLAMA | changes)
    return config, timeline(config, strategy, CPU)


@pytest.mark.parametrize("strategy", [NONE, TP], ids=["none", "tp"])
@pytest.mark.parametrize("attention", ["eager", "flash"])
def test_each_layer_adds_the_hf_ledgers_saved_tensors_less_the_shared_rope_tables(attention, strategy):
    config, steps = _timeline(strategy, attention=attention, t=2)
    ends = [m.by_category()[ACTIVATIONS] for m in steps.moments  # the layers' own moments (not down_proj's, under tp)
            if m.phase == "forward" and ".layers." in f".{m.where}" and m.where.rpartition(".")[2].isdigit()]
    ledger = {x.tensor.name: x.bytes for x in estimate(config, strategy, CPU).tensors}
    shared = ledger[rules.ROPE_COS.name] + ledger[rules.ROPE_SIN.name]
    # After the first layer (whose input is LlamaModel's inputs_embeds too, live to the end of forward), each
    # layer's end holds its input, the residual stream after attention, the MLP's output and its own output.
    assert [b - a for a, b in zip(ends[1:], ends[2:])] == [sum(ledger.values()) - shared] * (config.L - 2)


@pytest.mark.parametrize("tied", [False, True])
def test_the_weights_are_transformers_unpadded_vocabulary_and_ropes_two_fp32_buffers(tied):
    config, steps = _timeline(tie_embeddings=tied)
    params = total_params(config)  # as published: one stage, no vocabulary padding
    assert steps.steady.by_category()[PARAMETERS] == 2 * params + 2 * 4 * (config.h // config.a // 2)


def test_backward_leaves_only_the_batch_and_the_loss_behind():
    config, steps = _timeline()
    optimizer = steps.moments[-1]
    left = {x.name for x in optimizer.live if x.category in (ACTIVATIONS, TEMPORARIES)}
    assert left == {"embedding/input_ids", "batch/labels", "loss/value"}
    batch_and_loss = 2 * 8 * config.b * config.s + 4  # int64 token ids and labels, the fp32 loss
    steady = steps.steady.by_category()
    assert optimizer.by_category() == steady | {ACTIVATIONS: steady[ACTIVATIONS] + batch_and_loss}


@pytest.mark.parametrize("dtype, cast", [("bf16", 4), ("fp32", 0)])
def test_a_layers_forward_marks_eager_attentions_fp32_softmax_the_steps_peak_where_s_squared_dwarfs_h(dtype, cast):
    """eager_attention_forward's softmax: the masked scores (the local it rebinds) and, but in fp32, their fp32 cast
    (its input) beside the softmax it keeps; the weights cast back come after it. In bf16, when s^2 >> h, wider than
    the layer's end and the final norm: the step's peak (against MemTracker: tests/probe/libs/test_hf_fsdp.py)."""
    config, steps = _timeline(b=1, s=16, h=2, a=1, num_query_groups=1, ffn_hidden_size=1, vocab_size=2,
                              attention="eager", dtype=dtype)
    (softmax,) = [m for m in steps.moments if (m.phase, m.where, m.what) == (
        "forward", "model.layers.2.self_attn", "the fp32 softmax")]
    assert (steps.peak is softmax) == (dtype == "bf16")
    scores = config.b * config.a * config.s ** 2
    live = {x.name: x.bytes for x in softmax.live if x.name.startswith("layers.2/")}
    assert live["layers.2/scores masked"] == (4 if dtype == "fp32" else 2) * scores
    assert live.get("layers.2/scores fp32", 0) == cast * scores
    assert "layers.2/attention/softmax_fp32" in live and "layers.2/attention/weights" not in live

@pytest.mark.parametrize("changes, named", [
    ({"recompute": "full", "zero_stage": 3}, "recompute full \\(gradient checkpointing\\) with zero_stage=3"),
    ({"add_bias_linear": True}, "add_bias_linear"),
    ({"family": "qwen2", "add_qkv_bias": True, "dp_shard": 2}, "dp_shard or zero_stage with add_qkv_bias"),
    ({"family": "bloom", "norm": "layernorm", "alibi": True, "mlp": "gelu_tanh", "attention": "eager",
      "ffn_hidden_size": 256, "position_embedding_type": "alibi", "add_bias_linear": True, "num_query_groups": None},
     "bloom's model"),
    ({"family": "olmo", "norm": "layernorm_np", "zero_stage": 3}, "olmo's model under zero_stage"),
    ({"family": "starcoder2", "norm": "layernorm", "mlp": "gelu", "rotary_percent": 1.0, "add_bias_linear": True,
      "dp_shard": 2}, "StarCoder 2's model under dp_shard or zero_stage"),
    ({"family": "cohere", "norm": "layernorm_nb", "parallel_residual": True, "single_norm": True,
      "qk_layernorm": True}, "Cohere's model under dp_shard or zero_stage, or with use_qk_norm"),
    ({"position_embedding_type": "learned_absolute"}, "position_embedding_type learned_absolute"),
])
def test_what_the_hf_walk_does_not_model_is_refused_by_name(changes, named):
    with pytest.raises(ConfigError, match=f"for impl hf does not model {named}"):
        _timeline(**changes)


def test_pp_is_refused_saying_transformers_has_no_pipeline_schedule_and_who_pipelines_it():
    with pytest.raises(ConfigError, match="pp=2 \\(transformers has no pipeline schedule of its own: its"
                                          " base_model_pp_plan only names each stage.s inputs and outputs, for"
                                          " torchtitan.s experimental transformers backend; --impl torchtitan walks"
                                          " torchtitan.s Llama3 under its pipeline\\)"):
        _timeline(L=2, pp=2)


def test_sdpa_with_dropout_walks_the_math_kernel_on_a_cpu_and_the_flash_kernel_unchanged_on_cuda():
    """A CPU runs torch's math kernel, its fp32 scores live in forward and backward; CUDA's flash kernel drops out
    inside, regenerating its mask from the RNG state it allocates with or without dropout (read from torch's code)."""
    cuda = Accounting(exact=True, device="cuda")
    without, dropped = (build_config(LLAMA | {"attention": "flash", "dropout": p}) for p in (0.0, 0.1))
    assert [(m.label(), m.bytes) for m in timeline(dropped, NONE, cuda).moments] == [
        (m.label(), m.bytes) for m in timeline(without, NONE, cuda).moments]
    on_cpu = timeline(dropped, NONE, CPU)
    assert any("math kernel" in m.label() for m in on_cpu.moments)
    assert on_cpu.peak.bytes > timeline(without, NONE, CPU).peak.bytes


def test_in_fp32_the_step_keeps_no_master_copy_and_the_loss_no_copy_of_the_logits():
    """transformers trains fp32 weights as they are (no master copy); ForCausalLMLoss's logits.float() is a no-op,
    and each norm's x.to(float32) is the residual stream's tensor itself."""
    config, steps = _timeline(dtype="fp32")
    steady = {x.name: x.bytes for x in steps.steady.live}
    assert "states/master_weights" not in steady and steady["states/adam_m"] == steady["states/weights"]
    names = {x.name for m in steps.moments for x in m.live}
    assert "loss/logits fp32" not in names and "grad/logits fp32" not in names
    assert "layers.0/mid" not in names  # the stream after attention is ln2's fp32 input, by the ledger's name


def test_under_tp_the_loss_sees_every_logit_and_the_embedding_gradient_is_the_whole_table():
    """lm_head's colwise_gather_output gathers the logits, so the loss's fp32 tensors are t = 1's; DTensor gives the
    vocabulary-parallel embedding a Replicate gradient, the whole (v, h) table, before this rank's rows are taken."""
    _, none = _timeline(t=2)
    config, tp = _timeline(TP, t=2)
    loss = "log_softmax's backward: three fp32 (b*s, v) tensors"
    at = [m.by_category()[TEMPORARIES] for steps in (none, tp) for m in steps.moments if m.what == loss]
    assert at == [2 * 4 * config.b * config.s * config.vocab_size] * 2  # the third is kept from forward
    rows = next(m for m in tp.moments if m.what == "this rank's rows of the embedding's gradient")
    live = {x.name: x.bytes for x in rows.live}
    assert live["grad/embedding (.grad)"] == 2 * live["grad/embedding (rows)"] == 2 * config.vocab_size * config.h


def test_under_tp_a_tied_weights_gradient_is_this_ranks_rows_of_the_lookups_summed_with_lm_heads():
    """from_pretrained ties lm_head.weight to the embedding's Shard(0) DTensor after laying both out; DTensor adds the
    lookup's Replicate (v, h) gradient to lm_head's Shard(0) one by copying this rank's rows out first."""
    config, tp = _timeline(TP, t=2, tie_embeddings=True)
    summed = next(m for m in tp.moments if m.what == "the tied weight's two gradients summed")
    live = {x.name: x.bytes for x in summed.live}
    rows = 2 * config.vocab_size // config.t * config.h  # bf16
    assert [live[f"grad/embedding ({x})"] for x in ("lookup", "lm_head", "rows", "sum")] == [2 * rows, *[rows] * 3]


@pytest.mark.parametrize("changes, named", [
    ({"t": 2, "tie_embeddings": True, "dp_shard": 2}, "tied embeddings under tp with dp_shard or zero_stage"),
    ({"t": 4, "num_query_groups": 4}, "vocab_size=250 that t=4 does not divide"),
])
def test_what_the_hf_walk_does_not_model_under_tp_is_refused_by_name(changes, named):
    with pytest.raises(ConfigError, match=f"for impl hf does not model {named}"):
        _timeline(TP, **changes)


def test_hf_refuses_tp_sp_citing_transformers():
    with pytest.raises(ConfigError, match="does not run tp-sp .*transformers has no sequence parallelism"):
        _timeline(STRATEGIES["tp-sp"], t=2)


# -- transformers' MixtralForCausalLM: the balanced bound, kbs/E slots an expert ----------------------------------------

MIXTRAL = {"family": "mixtral", "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 48, "vocab_size": 40,
           "experts_implementation": "eager"}  # the loop the walk models


def test_mixtral_model_states_count_the_router_and_every_experts_weights():
    config, steps = _timeline(**MIXTRAL)
    rope = 2 * 4 * (config.h // config.a // 2)
    experts = config.L * (config.h * config.num_experts + config.num_experts * 3 * config.h * config.expert_ffn)
    dense = config.L * 3 * config.h * config.ffn
    assert steps.steady.by_category()[PARAMETERS] == 2 * total_params(config) + rope
    assert total_params(build_config(LLAMA | {"vocab_size": 40})) - dense + experts == total_params(config)


def test_each_expert_frees_its_own_share_of_the_kept_rows_when_its_backward_runs():
    """The ledger's expert rows are E storages; autograd runs the last expert first, so at expert e's first
    moment only experts 0..e of the last layer still hold theirs."""
    config, steps = _timeline(**MIXTRAL)
    last = f"layers.{config.L - 1}/"
    for e in range(config.num_experts):
        moment = next(m for m in steps.moments if m.what.startswith(f"expert {e}:"))
        held = {x.name.rpartition("[")[2] for x in moment.live if x.name.startswith(last) and x.name.endswith("]")}
        assert held == {f"{i}]" for i in range(e + 1)}


def test_the_experts_widest_moment_holds_gate_ups_gradient_three_times_beside_down_projs():
    config, steps = _timeline(**MIXTRAL)
    moment = next(m for m in steps.moments if m.what.startswith("gate_up's gradients summed"))
    whole = 2 * config.num_experts * 2 * config.expert_ffn * config.h  # bf16 (E, 2e, h)
    live = {x.name: x.bytes for x in moment.live}
    # the sum of the last expert's (3, the first autograd runs) and expert 2's, beside both
    assert sorted(n for n, b in live.items() if b == whole) == sorted(
        ["grad/moe/expert 3/gate_up select", "grad/moe/expert 2/gate_up select", "grad/moe/gate_up weights 1"])
    assert live["grad/moe/down weights 1"] == whole // 2


@pytest.mark.parametrize("changes, named", [
    ({"moe_tokens": "worst"}, "moe_tokens worst"),
    ({"num_experts": 5}, "k\\*b\\*s=96 slots that E=5 experts do not share evenly"),
    ({"ep": 2}, "ep=2"),
])
def test_what_the_mixtral_walk_does_not_model_is_refused_by_name(changes, named):
    with pytest.raises(ConfigError, match=f"for impl hf does not model {named}"):
        _timeline(**(MIXTRAL | changes))


def test_grouped_mm_walks_slots_its_experts_do_not_share_evenly_as_one_storage_a_tensor():
    """grouped_mm keeps all k*b*s slots in one storage a tensor: no per-expert rows, any E."""
    config, steps = _timeline(**(MIXTRAL | {"experts_implementation": "grouped_mm", "num_experts": 5}))
    moment = next(m for m in steps.moments if m.what.startswith("gate_up_proj's grouped GEMMs"))
    live = {x.name: x.bytes for x in moment.live}
    assert not any(name.endswith("]") for name in live)
    assert live["grad/moe/experts/gate_up dW"] == 2 * 5 * 2 * config.expert_ffn * config.h  # bf16 (E, h, 2e) at once


def test_with_decoder_sparse_step_only_every_freq_th_layer_walks_the_sparse_block():
    """Qwen2-MoE's decoder_sparse_step (moe_layer_freq): layer i is sparse when freq divides i + 1."""
    qwen2_moe = MIXTRAL | {"family": "qwen2_moe", "moe_shared_expert_intermediate_size": 64, "moe_layer_freq": 2}
    for layers, sparse in ((4, {"1", "3"}), (5, {"1", "3"}), (3, {"1"})):
        _, steps = _timeline(**(qwen2_moe | {"L": layers}))
        assert {m.where.split(".")[2] for m in steps.moments if ".mlp.experts" in m.where} == sparse


def test_experts_under_zero3_are_refused_by_name():
    with pytest.raises(ConfigError, match="for impl hf does not model zero_stage=3 with experts"):
        _timeline(**(MIXTRAL | {"zero_stage": 3}))


@pytest.mark.parametrize("path", ["grouped_mm", "eager"])
def test_under_fsdp2_each_expert_weight_is_its_own_unsharded_grad_until_the_reduce_scatter(path):
    """MixtralExperts hands over two weights' gradients from one module: FSDP2 keeps each as its own .grad."""
    config, steps = _timeline(**(MIXTRAL | {"experts_implementation": path, "dp_shard": 2}))
    moment = next(m for m in steps.moments if m.what == "FSDP2's reduce-scatter buffer for layers.1's gradients")
    live = {x.name: x.bytes for x in moment.live}
    experts = "fsdp/layers.1 grad model.layers.1.mlp.experts"
    assert live[f"{experts}.gate_up_proj"] == 2 * 4 * 2 * config.expert_ffn * config.h  # bf16 (E, 2e, h)
    assert live[f"{experts}.down_proj"] == 2 * 4 * config.h * config.expert_ffn
    assert live["fsdp/layers.1 grad model.layers.1.mlp.gate"] == 2 * 4 * config.h


def test_the_eager_loop_under_tp_is_refused_by_name():
    with pytest.raises(ConfigError, match="for impl hf does not model the eager loop's experts under tp"):
        _timeline(TP, t=2, **MIXTRAL)


def test_qwen2_moe_keeps_its_shared_experts_gate_sigmoid_only_from_after_the_experts_loop():
    """The gate's sigmoid is made after the routed experts: at the last expert it is not yet live, at the block's
    sum it is, beside the experts' and the gated shared expert's outputs."""
    config, steps = _timeline(**(MIXTRAL | {"family": "qwen2_moe", "moe_shared_expert_intermediate_size": 64}))
    last, summed = (next(m for m in steps.moments if m.where == "model.layers.0.mlp" + where and m.phase == "forward")
                    for where in (".experts", ""))
    sigmoid = "layers.0/" + rules.SHARED_GATE_SIGMOID.name
    assert sigmoid not in {x.name for x in last.live} and sigmoid in {x.name for x in summed.live}
    assert summed.bytes - last.bytes == (
        rules_bytes(config, rules.SHARED_GATE_SIGMOID) + 2 * 2 * config.b * config.s * config.h  # gated, the sum
        - 8 * config.b * config.s * config.moe_router_topk * (config.num_experts + 1) - 8 * config.num_experts)


def rules_bytes(config, tensor):
    """One layer's bytes of a ledger tensor at these sizes."""
    return next(x.bytes for x in estimate(config, NONE, CPU).tensors if x.tensor is tensor)


@pytest.mark.parametrize("proj, heads", [("q", "a"), ("k", "num_query_groups"), ("v", "num_query_groups")])
def test_qwen2s_bias_gradient_is_made_beside_its_projections_gemms(proj, heads):
    """add_qkv_bias: autograd sums each of q, k, v's bias gradients, (out,) wide, beside its GEMMs' outputs."""
    where = f"backward model.layers.0.self_attn.{proj}_proj"
    (plain,), (biased,) = ([m for m in _timeline(add_qkv_bias=bias, family="qwen2" if bias else None)[1].moments if m.label() == f"{where} ({what})"]
                           for bias, what in ((False, "GEMMs: dW and dX"),
                                              (True, "the bias's gradient: dY summed over the tokens")))
    out = LLAMA[heads] * LLAMA["h"] // LLAMA["a"]
    assert biased.by_category()[TEMPORARIES] - plain.by_category()[TEMPORARIES] == 2 * out


def test_attention_dropout_keeps_its_bool_mask_until_its_backward_runs():
    """Eager attention with dropout: the layer keeps native_dropout's 1-byte mask and the dropped-out weights instead of
    the softmax's bf16 cast; the mask goes at dropout's backward, which makes one gradient the size of the weights."""
    config, walked = _timeline(dropout=0.1, attention="eager")
    moment = next(m for m in walked.moments if "native_dropout_backward" in m.label())
    assert moment.where == "model.layers.2.self_attn"
    after = walked.moments[walked.moments.index(moment) + 1]
    scores = config.b * config.a * config.s * config.s
    assert moment.by_category()[ACTIVATIONS] - after.by_category()[ACTIVATIONS] == scores  # the bool mask went


GEMMA = {"family": "gemma", "norm": "rmsnorm_1p", "mlp": "geglu_tanh"}
GEMMA2 = GEMMA | {"family": "gemma2", "sandwich_norm": True}


def test_gemmas_layers_add_the_hf_ledgers_gemma_tensors_less_the_shared_rope_tables():
    config, steps = _timeline(**GEMMA)
    ends = [m.by_category()[ACTIVATIONS] for m in steps.moments  # the layers' own moments (not down_proj's, under tp)
            if m.phase == "forward" and ".layers." in f".{m.where}" and m.where.rpartition(".")[2].isdigit()]
    ledger = {x.tensor.name: x.bytes for x in estimate(config, NONE, CPU).tensors}
    assert rules.GEMMA_LN1.weight_plus_one.name in ledger and rules.GEGLU_GATE.name in ledger
    shared = ledger[rules.ROPE_COS.name] + ledger[rules.ROPE_SIN.name]
    assert [b - a for a, b in zip(ends[1:], ends[2:])] == [sum(ledger.values()) - shared] * (config.L - 2)


def test_gemmas_model_states_add_its_embedding_scale_a_0_d_buffer_in_the_weights_dtype():
    config, steps = _timeline(**GEMMA)
    llama = _timeline()[1].steady.by_category()[PARAMETERS]
    assert steps.steady.by_category()[PARAMETERS] == llama + 2
    final = {x.name for x in steps.moments[-1].live}
    assert "states/embed_tokens.embed_scale" in final


def test_gemma_under_dp_shard_is_refused_by_name():
    with pytest.raises(ConfigError, match="does not model gemma's model under dp_shard"):
        _timeline(dp_shard=2, **GEMMA)


def test_in_fp32_under_a_checkpoint_a_norms_weight_backward_holds_y_beside_dy_and_both_products():
    """The rerun's y goes as the node returns, before its product is summed to the weight's shape: Phi-3's
    post_attention_layernorm peaks there at b=3 s=3 h=4 (found by the step differential, 180 B above the walk)."""
    phi3 = {"family": "phi3", "fused_qkv": True, "attention": "eager", "recompute": "full", "b": 3, "s": 3, "h": 4,
            "a": 1, "num_query_groups": 1, "L": 1, "ffn_hidden_size": 1, "vocab_size": 2}
    _, steps = _timeline(**phi3, dtype="fp32")
    live = {x.name for x in steps.peak.live}
    assert steps.peak.what == "weight * y's backward: its two products"
    assert {"layers.0/ln2/normed", "grad/layers.0/post_attention_layernorm/dY y"} <= live
    _, bf16 = _timeline(**phi3)
    assert "weight * y's backward: its two products" not in {m.what for m in bf16.moments}  # bf16: a transient


def test_gemma_2s_final_logit_softcapping_keeps_tanhs_bsv_output_from_its_forward_to_its_backward():
    config, steps = _timeline(**GEMMA2, final_logit_softcapping=30.0, attention="eager")
    kept = 2 * config.b * config.s * config.vocab_size  # bf16, the unpadded vocabulary
    holding = [m.what for m in steps.moments if any(x.name == "loss/softcap_tanh" and x.bytes == kept
                                                    for x in m.live)]
    assert (holding[0], holding[-1]) == ("tanh(logits / c), which tanh keeps", "tanh's backward")
    _, uncapped = _timeline(**GEMMA2, attention="eager")
    assert steps.steady == uncapped.steady and steps.peak.bytes == uncapped.peak.bytes + kept  # the loss's backward


def test_gemma_2s_layers_add_its_sandwich_norms_and_soft_capping_as_the_ledger_keeps_them():
    config, steps = _timeline(**GEMMA2, attn_logit_softcapping=50.0, attention="eager")
    ends = [m.by_category()[ACTIVATIONS] for m in steps.moments  # the layers' own moments (not down_proj's, under tp)
            if m.phase == "forward" and ".layers." in f".{m.where}" and m.where.rpartition(".")[2].isdigit()]
    ledger = {x.tensor.name: x.bytes for x in estimate(config, NONE, CPU).tensors}
    assert {rules.GEMMA_POST_MLP.normed_fp32.name, rules.SOFTCAP_TANH.name} <= ledger.keys()
    shared = ledger[rules.ROPE_COS.name] + ledger[rules.ROPE_SIN.name]
    assert [b - a for a, b in zip(ends[1:], ends[2:])] == [sum(ledger.values()) - shared] * (config.L - 2)


def test_a_moment_no_step_is_titled_for_is_an_error_not_a_moment_left_unmarked():
    """hf_layer.widest marks the last step of each title it is given: a title no step has (a step renamed, or one
    path's title given to another path's ops) would silently drop that moment from the timeline."""
    op = Op("mlp", (Step("the GEMM", (Made("layers.0/x", 2, "an output"),)),), ())
    assert [x.what for x in widest((op,), {"the GEMM": "at its widest"})[0].forward] == ["", "at its widest", ""]
    with pytest.raises(AssertionError, match="the GEMMs"):
        widest((op,), {"the GEMMs": "at its widest"})


def test_each_step_of_a_name_in_each_marks_a_moment_in_its_own_words():
    """RoPE's fp32 forward (OLMo's, Cohere's) is wider than the layer's end at each of its steps, q's and k's of one
    name alike: `each` marks every one of them, where `moments` marks a name's last step only."""
    steps = tuple(Step("x * cos", (Made(f"layers.0/{n} cos", 4, "a temporary"),), frees=(f"layers.0/{n} pre",))
                  for n in ("q", "k"))
    ops = widest((Op("self_attn", steps, ()),), {}, frozenset({"x * cos"}))
    assert [x.what for x in ops[0].forward if x.makes] == ["x * cos", "x * cos"]


def test_a_tensor_an_alias_keeps_is_made_as_the_saved_one_at_the_moment_and_never_freed():
    """In fp32 a norm's x.to(float32) is x itself (`Made.alias`): without a checkpoint autograd keeps the projection's
    output the norm reads, so `widest` makes it as the saved tensor (sized by the ledger) and frees it nowhere."""
    saved = rules.OLMO2_Q_NORM.input_fp32
    ops = widest((Op("self_attn", (
        Step("q_proj", (Made("layers.0/q proj", 8, "q_proj's output"),)),
        Step("x.to(float32)", (Made("layers.0/q proj", 0, "x itself", keeps=saved, alias=True),)),
        Step("the norm's output", (Made("layers.0/q pre-rope", 8, "the norm's output"),), frees=("layers.0/q proj",)),
    ), ()),), {"the norm's output": "at its widest"})
    moment = next(x for x in ops[0].forward if x.what == "at its widest")
    assert [(x.name, x.keeps) for x in moment.makes] == [("", saved), ("layers.0/q pre-rope", None)]
    assert not any("layers.0/q proj" in x.frees for x in ops[0].forward)
