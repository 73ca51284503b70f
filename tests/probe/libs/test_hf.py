"""transformers' own layers keep, tensor by tensor, what memcalc's hf rules predict (bytes and shape)."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch  # noqa: E402
import transformers  # noqa: E402

from memcalc.config.schema import build_config  # noqa: E402
from memcalc.errors import ConfigError  # noqa: E402
from memcalc.model.evaluate import estimate  # noqa: E402
from memcalc.model.families import layer_family  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.group import single  # noqa: E402
from memcalc.probe.launch import run  # noqa: E402
from memcalc.probe.libs import hf as runner  # noqa: E402
from memcalc.probe.libs.hf_shim import cuda_like_dropout  # noqa: E402
from memcalc.probe.measure import compare  # noqa: E402
from memcalc.probe.recorder import SavedTensorRecorder  # noqa: E402

SIZES = {"b": 2, "s": 8, "h": 32, "a": 4, "ffn_hidden_size": 48, "impl": "hf"}
LLAMA = {"norm": "rmsnorm", "mlp": "swiglu"}
GPT2 = {"norm": "layernorm", "mlp": "gelu"}  # transformers' own defaults are Llama's
MLA = {"family": "deepseek_v3", "kv_lora_rank": 24, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 12, "v_head_dim": 10}
QWEN3 = LLAMA | {"family": "qwen3", "kv_channels": 16, "qk_layernorm": True, "num_query_groups": 2}  # heads of 16, not h/a = 8
GEMMA = {"family": "gemma", "norm": "rmsnorm_1p", "mlp": "geglu_tanh", "kv_channels": 16, "num_query_groups": 2}
GEMMA2 = GEMMA | {"family": "gemma2", "sandwich_norm": True, "attn_logit_softcapping": 50.0, "attention": "eager"}
GEMMA3 = GEMMA | {"family": "gemma3_text", "sandwich_norm": True, "qk_layernorm": True}
FALCON = GPT2 | {"family": "falcon", "parallel_residual": True, "single_norm": True, "num_query_groups": 1, "attention": "eager",
                 "dropout": 0.0}  # Falcon-7B's
# Falcon-40B/180B's new_decoder_architecture: the grouped query_key_value, ln_attn and ln_mlp, sdpa by default
FALCON40 = GPT2 | {"family": "falcon", "parallel_residual": True, "fused_qkv": True, "num_query_groups": 2, "dropout": 0.0}
BLOOM = GPT2 | {"family": "bloom", "mlp": "gelu_tanh", "alibi": True, "attention": "eager", "ffn_hidden_size": None}  # BloomMLP: 4h
GLM = LLAMA | {"family": "glm", "rotary_percent": 0.5, "kv_channels": 16, "num_query_groups": 2}  # GlmDecoderLayer; + sandwich: GLM-4
NEOX = {"family": "gpt_neox", "norm": "layernorm", "mlp": "gelu", "rotary_percent": 0.25, "parallel_residual": True, "attention": "eager",
        "fused_qkv": True}
GPTJ = {"family": "gptj", "norm": "layernorm", "mlp": "gelu_tanh", "rotary_percent": 0.25, "parallel_residual": True,
        "single_norm": True}
STARCODER2 = {"family": "starcoder2", "norm": "layernorm", "mlp": "gelu", "rotary_percent": 1.0, "num_query_groups": 2}
PHI3 = LLAMA | {"family": "phi3", "fused_qkv": True, "attention": "eager"}
COHERE = {"family": "cohere", "norm": "layernorm_nb", "mlp": "swiglu", "parallel_residual": True, "single_norm": True,
          "num_query_groups": 2}
OLMO2 = {"family": "olmo2", "norm": "rmsnorm_fp32w", "mlp": "swiglu", "post_norm": True, "qk_layernorm": True, "num_query_groups": 2}


def _rows(knobs: dict, family: str | None = None):
    config = build_config(SIZES | knobs | ({"family": family} if family else {}))
    saved = runner.run_layer(single("cpu"), config, STRATEGIES["none"])
    prediction = estimate(config, STRATEGIES["none"], Accounting(exact=True, device="cpu"))
    return compare(prediction, saved)


def _differences(rows) -> list[str]:
    return [row.describe() for row in rows if not row.matches]


CASES = {
    "llama eager: fp32 softmax and its bf16 cast, matmul's copies of q, k, v, RoPE tables":
        (LLAMA | {"attention": "eager", "dropout": 0.0}, None),
    "llama eager gqa with dropout: repeat_kv copies, a bool mask, no bf16 cast":
        (LLAMA | {"attention": "eager", "dropout": 0.1, "num_query_groups": 2}, None),
    "llama sdpa gqa: flash kernel keeps k, v at g heads, the lse, and its output as o_proj's input":
        (LLAMA | {"attention": "flash", "dropout": 0.0, "num_query_groups": 2}, None),
    "llama sdpa with dropout on a cpu: torch's math kernel in fp32":
        (LLAMA | {"attention": "flash", "dropout": 0.1, "num_query_groups": 2}, None),
    "mistral keeps what llama keeps":
        (LLAMA | {"attention": "eager", "dropout": 0.1, "num_query_groups": 2}, "mistral"),
    "qwen2's qkv bias keeps nothing more": (LLAMA | {"attention": "flash", "dropout": 0.0, "add_qkv_bias": True}, "qwen2"),
    "llama fp32: the softmax cast is a no-op, one storage": (LLAMA | {"attention": "eager", "dtype": "fp32"}, None),
    "llama b=1 with one k/v group: repeat_kv's expand is a view, matmul keeps k and v at one head":
        (LLAMA | {"attention": "eager", "dropout": 0.0, "num_query_groups": 1, "b": 1}, None),
    "gpt2 eager gelu_new: four f-wide tensors, resid and mlp dropout masks":
        (GPT2 | {"mlp": "gelu_tanh", "attention": "eager", "dropout": 0.1}, None),
    "gpt2 sdpa gelu: q, k, v as one c_attn storage, split into ledger rows":
        (GPT2 | {"mlp": "gelu", "attention": "flash", "dropout": 0.0}, None),
    "gradient checkpointing keeps the layer input only": (LLAMA | {"recompute": "full", "dropout": 0.1}, None),
    "qwen3 eager: q_norm and k_norm keep an fp32 input, rstd and bf16 output per head; heads of head_dim":
        (QWEN3 | {"attention": "eager", "dropout": 0.0}, None),
    "qwen3 sdpa: the flash kernel keeps the normed, rotated q and k at a and g heads of head_dim":
        (QWEN3 | {"attention": "flash", "dropout": 0.0}, None),
    "qwen3 sdpa with dropout on a cpu, multi-head": (QWEN3 | {"attention": "flash", "dropout": 0.1,
                                                              "num_query_groups": None}, None),
    "qwen3 fp32: the norms' casts are no-ops": (QWEN3 | {"attention": "eager", "dtype": "fp32"}, None),
    "llama with head_dim not h/a (Mistral-Nemo's): q, k, v and o_proj's input a*d wide":
        (LLAMA | {"attention": "eager", "dropout": 0.0, "num_query_groups": 2, "kv_channels": 12}, "mistral"),
    "deepseek-v3 latent attention, eager: fp32 latent norms, up projections' inputs, one rope table pair":
        (LLAMA | MLA | {"attention": "eager", "dropout": 0.0}, None),
    "gemma eager: (1 + w) rmsnorm keeps fp32 input, rstd, normed and 1 + w; tanh geglu keeps gate, up, gelu out":
        (GEMMA | {"attention": "eager", "dropout": 0.0}, None),
    "gemma sdpa with dropout on a cpu": (GEMMA | {"attention": "flash", "dropout": 0.1}, None),
    "gemma2 with dropout: four norms, soft-capping keeps tanh's (b, a, s, s) output": (GEMMA2 | {"dropout": 0.1}, None),
    "gemma2 without soft-capping, b=1": (GEMMA2 | {"attn_logit_softcapping": None, "dropout": 0.0, "b": 1}, None),
    "gemma3 eager: q_norm and k_norm keep gemma's four tensors per head": (GEMMA3 | {"attention": "eager",
                                                                                     "dropout": 0.0}, None),
    "gemma3 sdpa with dropout on a cpu": (GEMMA3 | {"attention": "flash", "dropout": 0.1}, None),
    "gemma fp32": (GEMMA | {"attention": "eager", "dtype": "fp32"}, None),
    "olmo eager with dropout: each weightless layernorm keeps an fp32 copy of its input, fp32 mean and rstd":
        ({"norm": "layernorm_np", "mlp": "swiglu", "attention": "eager", "dropout": 0.1}, "olmo"),
    "olmo sdpa gqa": ({"norm": "layernorm_np", "mlp": "swiglu", "attention": "flash", "dropout": 0.0,
                      "num_query_groups": 2}, "olmo"),
    "gpt-neox, parallel residual: both norms read the layer's input, kept once; (s, d/4) rope tables, fp32 softmax":
        (NEOX | {"dropout": 0.0}, None),
    "gpt-neox sequential residual with dropout and gelu_new, whole heads rotated":
        (NEOX | {"dropout": 0.1, "parallel_residual": False, "mlp": "gelu_tanh", "rotary_percent": 1.0}, None),
    "gpt-neox at b=1: matmul keeps V as the fused query_key_value output it views":
        (NEOX | {"dropout": 0.1, "b": 1}, None),
    "deepseek-v2-lite latent attention, no query latent, with dropout":
        (LLAMA | MLA | {"q_lora_rank": None, "attention": "eager", "dropout": 0.1}, None),
    # issue 18, found by tests/probe/test_differential.py: bmm takes q, k^T, v as views of c_attn's output
    "gpt2 eager with one head: q, k, v are c_attn's output, split into ledger rows":
        (GPT2 | {"attention": "eager", "dropout": 0.0, "a": 1}, None),
    "deepseek-v3 latent attention in fp32: the kv norm's input is a view of kv_a's whole output":
        (LLAMA | MLA | {"attention": "eager", "dtype": "fp32", "dropout": 0.0}, None),
    "gpt2 eager at b=1: the (b, a) batch flattens as a view": (GPT2 | {"attention": "eager", "dropout": 0.1, "b": 1},
                                                               None),
    # found by tests/probe/test_differential.py: in fp32 the math kernel's cast of v is a no-op
    "gpt2 fp32 sdpa with dropout at b=1: the math kernel's bmm keeps c_attn's whole output":
        (GPT2 | {"attention": "flash", "dropout": 0.1, "dtype": "fp32", "b": 1}, None),
    "gpt2 fp32 sdpa with dropout, one head: the math kernel's bmm keeps c_attn's whole output":
        (GPT2 | {"attention": "flash", "dropout": 0.1, "dtype": "fp32", "a": 1}, None),
    "gpt2 fp32 sdpa with dropout: the batch's reshape copies v":
        (GPT2 | {"attention": "flash", "dropout": 0.1, "dtype": "fp32", "b": 2}, None),
    "phi3 gqa: q, k, v sliced from qkv_proj, gate and up two halves of gate_up_proj's one storage":
        (PHI3 | {"dropout": 0.0, "num_query_groups": 2}, None),
    "phi3 with dropout: the attention's and the mlp's outputs dropped out too; (s, 3d/4) rope tables":
        (PHI3 | {"dropout": 0.1, "rotary_percent": 0.75}, None),
    "phi3 at b=1: matmul keeps V as the whole qkv_proj output it views": (PHI3 | {"dropout": 0.0, "b": 1}, None),
    "phi3 at b=1 with one k/v group: K itself, V as the qkv_proj output":
        (PHI3 | {"dropout": 0.1, "b": 1, "num_query_groups": 1}, None),
    "phi3 fp32": (PHI3 | {"dtype": "fp32", "num_query_groups": 2}, None),
    "olmo2 eager: no input norms; post-norms, q_norm and k_norm keep fp32 input, rstd and fp32 normed; fp32 rope":
        (OLMO2 | {"attention": "eager", "dropout": 0.0}, None),
    "olmo2 sdpa with dropout on a cpu, multi-head": (OLMO2 | {"attention": "flash", "dropout": 0.1,
                                                              "num_query_groups": None}, None),
    "olmo2 sdpa gqa": (OLMO2 | {"attention": "flash", "dropout": 0.0}, None),
    "olmo2 fp32 at b=1": (OLMO2 | {"attention": "eager", "dtype": "fp32", "b": 1}, None),
    "falcon multi_query: one norm's output read by attention and mlp, the one k/v head broadcast by matmul, bf16 softmax":
        (FALCON, None),
    "falcon multi_query at b=1, odd s: matmul keeps the one k and v head as they are; gelu_new, biases, fp32":
        (FALCON | {"b": 1, "s": 7, "mlp": "gelu_tanh", "add_bias_linear": True, "dtype": "fp32"}, None),
    "falcon multi-head at b=1: matmul keeps V as the fused query_key_value output it views":
        (FALCON | {"num_query_groups": None, "b": 1}, None),
    "bloom: alibi keeps nothing; fp32 softmax and its cast; its tanh gelu keeps its input alone":
        (BLOOM | {"dropout": 0.0}, None),
    "bloom at b=1 with dropout: q, k, v are views of the fused output; both dropouts' masks":
        (BLOOM | {"dropout": 0.1, "b": 1, "s": 7}, None),
    "bloom fp32": (BLOOM | {"dropout": 0.0, "dtype": "fp32"}, None),
    "glm eager: interleaved (s, d_r) rope tables, gate_up's one output kept as gate and up":
        (GLM | {"attention": "eager", "dropout": 0.0}, None),
    "glm4 sdpa: sandwich norms; the flash kernel keeps its output, laid out as the cat query, apart from o_proj's copy":
        (GLM | {"attention": "flash", "dropout": 0.0, "sandwich_norm": True}, "glm4"),
    "glm sdpa with dropout on a cpu: the math kernel keeps no output of its own":
        (GLM | {"attention": "flash", "dropout": 0.1}, None),
    "glm fp32 at b=1 with one k/v group, whole heads rotated":
        (GLM | {"attention": "eager", "dtype": "fp32", "b": 1, "num_query_groups": 1, "rotary_percent": 1.0}, None),
    "starcoder2 eager gqa with dropout: layernorms, whole-head rope tables, repeat_kv copies, the weights' and both"
    " residual dropouts' masks": (STARCODER2 | {"attention": "eager", "dropout": 0.1}, None),
    "starcoder2 sdpa gqa: its gelu_pytorch_tanh keeps its input alone":
        (STARCODER2 | {"attention": "flash", "dropout": 0.0}, None),
    "starcoder2 sdpa with dropout on a cpu, multi-head, gelu_new":
        (STARCODER2 | {"attention": "flash", "dropout": 0.1, "num_query_groups": None, "mlp": "gelu_tanh"}, None),
    "starcoder2 at b=1, odd s, one k/v group: K and V themselves":
        (STARCODER2 | {"attention": "eager", "dropout": 0.0, "b": 1, "s": 7, "num_query_groups": 1}, None),
    "gptj eager with dropout: one layernorm read by attention and mlp, fp32 q and k, four interleaved rope tables":
        (GPTJ | {"attention": "eager", "dropout": 0.1}, None),
    "gptj eager at b=1, odd s, whole heads rotated, gelu": (GPTJ | {"attention": "eager", "dropout": 0.0, "b": 1,
                                                                    "s": 7, "rotary_percent": 1.0, "mlp": "gelu"}, None),
    "gptj sdpa": (GPTJ | {"attention": "flash", "dropout": 0.0}, None),
    "gptj sdpa with dropout on a cpu": (GPTJ | {"attention": "flash", "dropout": 0.1}, None),
    "gptj fp32": (GPTJ | {"attention": "eager", "dropout": 0.0, "dtype": "fp32"}, None),
    "cohere eager gqa with dropout and use_qk_norm: one fp32 layernorm read by attention and mlp, x - mean kept"
    " twice, per-head q and k norms": (COHERE | {"attention": "eager", "dropout": 0.1, "qk_layernorm": True}, None),
    "cohere eager at b=1, odd s, one k/v group: K and V themselves":
        (COHERE | {"attention": "eager", "dropout": 0.0, "b": 1, "s": 7, "num_query_groups": 1}, None),
    "cohere sdpa at b=1, odd s, use_qk_norm":
        (COHERE | {"attention": "flash", "dropout": 0.0, "b": 1, "s": 7, "qk_layernorm": True}, None),
    "cohere sdpa with dropout on a cpu, multi-head":
        (COHERE | {"attention": "flash", "dropout": 0.1, "num_query_groups": None}, None),
    "cohere fp32 with use_qk_norm: the weights' casts are the parameters, no copies":
        (COHERE | {"attention": "eager", "dropout": 0.0, "dtype": "fp32", "qk_layernorm": True}, None),
    "falcon new_decoder_architecture sdpa: ln_attn and ln_mlp on one input, K and V broadcast to every head":
        (FALCON40, None),
    "falcon new_decoder_architecture sdpa, one group: V as the index output SDPA's broadcast view reads":
        (FALCON40 | {"num_query_groups": 1}, None),
    "falcon new_decoder_architecture sdpa at b=1, odd s, 6 heads in 3 groups, fp32, biases":
        (FALCON40 | {"b": 1, "s": 7, "h": 48, "a": 6, "num_query_groups": 3, "dtype": "fp32", "add_bias_linear": True},
         None),
    "falcon new_decoder_architecture eager at b=3, odd s: rotated K at every head, matmul's copy of V":
        (FALCON40 | {"attention": "eager", "b": 3, "s": 5}, None),
    "falcon new_decoder_architecture eager at b=1, one group: matmul keeps V as the index output it broadcasts":
        (FALCON40 | {"attention": "eager", "b": 1, "s": 7, "num_query_groups": 1}, None),
    "falcon new_decoder_architecture eager, a group a head, one norm (num_ln_in_parallel_attn 1), gelu_new, fp32":
        (FALCON40 | {"attention": "eager", "num_query_groups": None, "single_norm": True, "mlp": "gelu_tanh",
                     "dtype": "fp32"}, None),
    "starcoder2 mha at b=1: V is v_proj's own output, no fused storage":
        (STARCODER2 | {"attention": "eager", "dropout": 0.1, "b": 1, "num_query_groups": None}, None),
}


@pytest.mark.parametrize("knobs, family", CASES.values(), ids=CASES.keys())
def test_the_layer_keeps_exactly_what_the_rules_predict(knobs, family):
    rows = _rows(knobs, family)
    assert _differences(rows) == []
    assert all(row.measured > 0 for row in rows)  # every predicted tensor was found, none unlabelled


def _layers_saved(knobs: dict) -> tuple[int, int]:
    """transformers' own model of these knobs run on inputs_embeds: the bytes its decoder layers keep (recorded from
    the first layer's start to the last one's end, the rotary embedding's tables included), and the ledger's."""
    config = build_config(SIZES | knobs)
    family = layer_family(config).name
    hf_config = runner.transformers_config(config, family)
    hf_config.pad_token_id = None  # GLM's lies past a small vocabulary; the embedding is not run
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(hf_config).to(torch.bfloat16).train()
    recorder = SavedTensorRecorder(model.parameters(), kept_only=True)
    layers = model.layers if hasattr(model, "layers") else model.h  # Falcon's and GPT-J's
    layers[0].register_forward_pre_hook(lambda *_: None if recorder.__enter__() else None)
    layers[-1].register_forward_hook(lambda *_: recorder.__exit__(None, None, None))  # returns None
    x = torch.randn(config.b, config.s, config.h, dtype=torch.bfloat16, requires_grad=True)
    with cuda_like_dropout():
        model(inputs_embeds=x).last_hidden_state.sum().backward()
    predicted = estimate(config, STRATEGIES["none"], Accounting(exact=True, device="cpu")).total_bytes
    return sum(x.nbytes for x in recorder.saved), predicted


@pytest.mark.parametrize("knobs", [
    LLAMA | {"attention": "eager", "num_query_groups": 2, "b": 1, "s": 7, "L": 2},  # bf16 tables, once
    LLAMA | {"attention": "flash", "L": 3},
    {"family": "olmo", "norm": "layernorm_np", "mlp": "swiglu", "attention": "flash", "dropout": 0.0, "L": 3},  # fp32 tables
    GLM | {"attention": "eager", "L": 2, "b": 3, "s": 5},  # each layer's own interleaved tables
    NEOX | {"L": 3, "dropout": 0.0},  # the model's partial (s, d_r) tables
    LLAMA | MLA | {"attention": "eager", "dropout": 0.0, "L": 2},  # DeepSeek-V3: the (s, d_r) tables, sliced views
    GEMMA | {"attention": "flash", "L": 3, "b": 1, "s": 9},
    COHERE | {"attention": "eager", "L": 2},  # its rotary embedding interleaves the tables once, for every layer
    GEMMA3 | {"attention": "eager", "L": 5},  # five sliding layers: the local pair only
    GEMMA3 | {"attention": "flash", "L": 7, "b": 1},  # the sixth is full: the global pair too
    FALCON | {"L": 3},
    GPTJ | {"attention": "eager", "dropout": 0.0, "L": 2},  # each layer repeats the model's (s, d_r/2) tables
    STARCODER2 | {"attention": "flash", "dropout": 0.0, "L": 2},
], ids=["llama eager L=2", "llama sdpa L=3", "olmo sdpa L=3", "glm eager L=2", "gpt-neox eager L=3",
        "deepseek-v3 eager L=2", "gemma sdpa L=3", "cohere eager L=2", "gemma3 eager L=5", "gemma3 sdpa L=7",
        "falcon eager L=3", "gpt-j eager L=2", "starcoder2 sdpa L=2"])
def test_a_models_layers_keep_the_ledgers_l_layer_total_with_the_rope_tables_once(knobs):
    measured, predicted = _layers_saved(knobs)
    assert measured == predicted


def test_gpt2_sdpa_predicts_q_k_v_as_a_third_of_the_c_attn_storage_each():
    rows = {row.name: row for row in _rows(GPT2 | {"mlp": "gelu", "attention": "flash", "dropout": 0.0})}
    b, s, h, a = (SIZES[k] for k in "bsha")
    assert [rows[n].measured for n in ("attention/q", "attention/k", "attention/v")] == [2 * b * s * h] * 3
    assert rows["attention/q"].measured_shape == (b, a, s, h // a)


def test_qwen3s_heads_are_head_dim_wide_and_its_qk_norms_add_a_copy_of_q_and_k_each():
    rows = {row.name: row for row in _rows(QWEN3 | {"attention": "eager", "dropout": 0.0})}
    b, s, a, g, d = SIZES["b"], SIZES["s"], SIZES["a"], 2, 16
    assert rows["attention/q"].measured_shape == rows["attention/q_norm_normed"].measured_shape == (b, a, s, d)
    assert rows["attention/k_norm_input_fp32"].measured == 4 * b * g * s * d
    assert rows["attention/proj_in"].measured == 2 * b * s * a * d  # a*d = 64 columns, h = 32


def test_the_shim_makes_cpu_dropout_keep_a_bool_mask_and_undoes_itself():
    original = torch.nn.functional.dropout
    x = torch.randn(4, 4, dtype=torch.bfloat16, requires_grad=True)
    with cuda_like_dropout(), SavedTensorRecorder() as recorder:
        torch.nn.functional.dropout(x * 1, 0.1, True)
    assert [s.dtype for s in recorder.saved] == ["bool"]
    assert torch.nn.functional.dropout is original


@pytest.mark.parametrize("knobs, words", [
    ({"norm": "rmsnorm", "mlp": "gelu"}, "no transformers layer has norm rmsnorm with mlp gelu"),
    (LLAMA | {"recompute": "selective"}, "no selective recomputation"),
    (LLAMA | {"recompute": "op"}, "no op recomputation"),
    (GPT2 | {"num_query_groups": 2}, "GPT2Block has no grouped-query attention"),
    (GPT2 | {"qk_layernorm": True}, "GPT2Block, which has no qk_layernorm"),
    (GPT2 | {"kv_channels": 16}, "GPT2Block has no kv_channels"),
    (GPT2 | {"family": "falcon", "kv_channels": 16, "parallel_residual": True, "single_norm": True,
             "attention": "eager"}, "FalconDecoderLayer has no kv_channels"),  # the family's own layer, named so
    (NEOX | {"attention": "flash"}, "GPTNeoXLayer under sdpa is not modelled"),
    (GEMMA2 | {"attention": "flash"}, "attn_logit_softcapping runs in eager attention only"),
    (GEMMA2 | {"attn_logit_softcapping": None, "attention": "flash"}, "Gemma2ForCausalLM runs eager attention only"),
    (GEMMA | {"attn_logit_softcapping": 30.0, "attention": "eager"}, "attn_logit_softcapping is Gemma 2's"),
    (LLAMA | {"final_logit_softcapping": 30.0}, "final_logit_softcapping is Gemma 2's"),
    (GEMMA2 | {"final_logit_softcapping": 30.0, "impl": "megatron"}, "modelled under --impl hf only"),
    (LLAMA | {"sandwich_norm": True}, "LlamaDecoderLayer, which has no sandwich_norm"),
    (LLAMA | {"parallel_residual": True}, "LlamaDecoderLayer, which has no parallel_residual"),
    (FALCON | {"attention": "flash"}, "FalconDecoderLayer's first layout under sdpa is not modelled"),
    (FALCON | {"single_norm": False}, "FalconDecoderLayer's first layout .* has one input_layernorm: set single_norm"),
    (FALCON40 | {"dropout": 0.1}, "dropout 0.1 in FalconDecoderLayer is not modelled"),
    (BLOOM | {"attention": "flash"}, "BloomAttention has no sdpa path"),
    (BLOOM | {"ffn_hidden_size": 48}, "BloomMLP is 4h wide"),
    (LLAMA | {"alibi": True}, "LlamaDecoderLayer, which has no alibi"),
    (FALCON | {"dropout": 0.1}, "dropout 0.1 in FalconDecoderLayer is not modelled"),
    (FALCON | {"num_query_groups": 2}, "or new_decoder_architecture's groups with fused_qkv"),
    (GEMMA | {"rotary_percent": 0.5}, "GemmaDecoderLayer, which has no rotary_percent"),
    (GLM | {"family": "glm4", "sandwich_norm": True, "attn_logit_softcapping": 30.0, "attention": "eager"},
     "attn_logit_softcapping is Gemma 2's"),
    (NEOX | {"rotary_percent": 1.5}, r"rotary_percent=1.5 must be in \(0, 1\]"),
    (PHI3 | {"attention": "flash"}, "Phi3DecoderLayer under sdpa is not modelled"),
    (LLAMA | {"post_norm": True, "qk_layernorm": True}, "LlamaDecoderLayer, which has no qk_layernorm, has no post_norm"),
    (OLMO2 | {"qk_layernorm": False}, "Olmo2DecoderLayer, which needs qk_layernorm True"),
    (PHI3 | {"qk_layernorm": True}, "Phi3DecoderLayer, which has no qk_layernorm"),
    (GPT2 | {"fused_qkv": True}, "GPT2Block, which has no fused_qkv"),
    (STARCODER2 | {"rotary_percent": 0.5}, "Starcoder2DecoderLayer, which needs rotary_percent 1.0"),
    (STARCODER2 | {"parallel_residual": True}, "Starcoder2DecoderLayer, which has no parallel_residual"),
    (GPTJ | {"parallel_residual": False}, "GPTJBlock, which needs parallel_residual True"),
    (NEOX | {"single_norm": True}, "GPTNeoXLayer, which has no single_norm"),
    (GPTJ | {"num_query_groups": 2}, "GPTJBlock has no grouped-query attention"),
    (LLAMA | {"single_norm": True}, "LlamaDecoderLayer, which has no single_norm"),
    (COHERE | {"single_norm": False}, "CohereDecoderLayer, which needs single_norm True"),
    (COHERE | {"rotary_percent": 0.5}, "CohereDecoderLayer, which has no rotary_percent"),
    (COHERE | {"sandwich_norm": True}, "CohereDecoderLayer, which has no sandwich_norm"),
    (COHERE | {"mlp": "gelu"}, "no transformers layer has norm layernorm_nb with mlp gelu"),
])
def test_knobs_no_transformers_layer_runs_are_refused(knobs, words):
    with pytest.raises(ConfigError, match=words):
        estimate(build_config(SIZES | knobs), STRATEGIES["none"])




# -- tensor parallelism: transformers' own plan, applied by its own function ---------------------------------------


def _tp_rows(knobs: dict, t: int, family: str | None = None, mode: str = "fake"):
    """Each rank's rows under transformers' tp_plan at t (rank 0 of the fake group, or every spawned rank)."""
    config = build_config(SIZES | knobs | {"t": t} | ({"family": family} if family else {}))
    prediction = estimate(config, STRATEGIES["tp"], Accounting(exact=True, device="cpu"))
    per_rank = run(runner.run_layer, (config, STRATEGIES["tp"]), mode=mode, t=t)
    return [compare(prediction, saved) for saved in per_rank]


TP_CASES = {
    "eager gqa t=2: colwise inputs whole, heads, k/v groups and the mlp width split":
        (LLAMA | {"attention": "eager", "dropout": 0.0, "num_query_groups": 2}, 2, None),
    "sdpa gqa t=2: the flash kernel keeps k and v at g/t groups":
        (LLAMA | {"attention": "flash", "dropout": 0.0, "num_query_groups": 2}, 2, None),
    "sdpa with dropout t=2: torch's math kernel on this rank's heads":
        (LLAMA | {"attention": "flash", "dropout": 0.1, "num_query_groups": 2}, 2, None),
    "eager with dropout t=4, one k/v group per rank":
        (LLAMA | {"attention": "eager", "dropout": 0.1, "num_query_groups": 4, "a": 8, "h": 64}, 4, None),
    "eager mha t=4": (LLAMA | {"attention": "eager", "dropout": 0.0}, 4, None),
    "mistral t=2": (LLAMA | {"attention": "eager", "dropout": 0.1, "num_query_groups": 2}, 2, "mistral"),
    "qwen2 t=2: the colwise q/k/v biases are split, nothing more kept":
        (LLAMA | {"attention": "flash", "dropout": 0.0, "add_qkv_bias": True}, 2, "qwen2"),
    "gradient checkpointing t=2: the layer's whole input": (LLAMA | {"recompute": "full", "dropout": 0.1}, 2, None),
    "fp32 t=2": (LLAMA | {"attention": "eager", "dtype": "fp32", "num_query_groups": 2}, 2, None),
    "b=1, one k/v group per rank t=2: matmul keeps k and v unexpanded (repeat_kv's views)":
        (LLAMA | {"attention": "eager", "dropout": 0.1, "num_query_groups": 2, "b": 1}, 2, None),
    "gemma t=2: its norms whole (1 + w replicated), geglu's f split":
        (GEMMA | {"attention": "eager", "dropout": 0.0}, 2, "gemma"),
    "gemma2 t=2: its four norms whole, the (b, a/t, s, s) tanh split":
        (GEMMA2 | {"dropout": 0.0}, 2, "gemma2"),
    "gemma3 t=2": (GEMMA3 | {"attention": "eager", "dropout": 0.0}, 2, "gemma3_text"),
    "olmo t=2": ({"norm": "layernorm_np", "mlp": "swiglu", "attention": "eager", "dropout": 0.0}, 2, "olmo"),
    "phi3 t=2: its plan gathers qkv_proj's and gate_up_proj's outputs, so each rank runs every head and the whole"
    " gate and up; only o_proj's and down_proj's inputs are split":
        (PHI3 | {"dropout": 0.0, "num_query_groups": 2}, 2, "phi3"),
    "phi3 t=2 at b=1 with dropout and partial rope: V as the gathered qkv_proj output":
        (PHI3 | {"dropout": 0.1, "b": 1, "rotary_percent": 0.5}, 2, "phi3"),
    "olmo2 t=2: its plan gathers q, k and v, so each rank norms and attends over every head; the mlp is split":
        (OLMO2 | {"attention": "eager", "dropout": 0.0}, 2, "olmo2"),
    "olmo2 t=2 at b=1 with two k/v groups: every rank holds both, so matmul copies them":
        (OLMO2 | {"attention": "eager", "dropout": 0.1, "b": 1}, 2, "olmo2"),
    "olmo2 sdpa t=2: the flash kernel's output is a storage of its own beside o_proj's split copy":
        (OLMO2 | {"attention": "flash", "dropout": 0.0}, 2, "olmo2"),
    "glm4 t=2: gate_up's output gathered (gate, up and SiLU's output whole), down_proj's input this rank's f/t":
        (GLM | {"attention": "eager", "dropout": 0.0, "sandwich_norm": True}, 2, "glm4"),
    "glm sdpa t=2": (GLM | {"attention": "flash", "dropout": 0.0}, 2, "glm"),
    "starcoder2 t=2: its plan is the paper's (q, k, v, c_fc colwise; o_proj, c_proj rowwise), layernorms whole":
        (STARCODER2 | {"attention": "eager", "dropout": 0.1}, 2, "starcoder2"),
    "starcoder2 sdpa t=2 at b=1, odd s, one k/v group per rank":
        (STARCODER2 | {"attention": "flash", "dropout": 0.0, "b": 1, "s": 7}, 2, "starcoder2"),
    "starcoder2 eager t=2 at b=1, odd s, one k/v group per rank: K and V unexpanded":
        (STARCODER2 | {"attention": "eager", "dropout": 0.1, "b": 1, "s": 7}, 2, "starcoder2"),
    "gptj t=2: its plan is the paper's; ln_1's output whole, fp32 q and k on this rank's heads, rope tables whole":
        (GPTJ | {"attention": "eager", "dropout": 0.1}, 2, "gptj"),
    "gptj sdpa t=2 at b=1, odd s": (GPTJ | {"attention": "flash", "dropout": 0.0, "b": 1, "s": 7}, 2, "gptj"),
    "gptj eager t=2 at b=1, odd s": (GPTJ | {"attention": "eager", "dropout": 0.0, "b": 1, "s": 7}, 2, "gptj"),
    "cohere t=2: its plan is the paper's; the one norm's fp32 tensors and output whole, heads and f split":
        (COHERE | {"attention": "eager", "dropout": 0.1}, 2, "cohere"),
    "cohere sdpa t=2 at b=1, odd s, one k/v group per rank":
        (COHERE | {"attention": "flash", "dropout": 0.0, "b": 1, "s": 7}, 2, "cohere"),
    "cohere eager t=2 at b=1, odd s, multi-head":
        (COHERE | {"attention": "eager", "dropout": 0.0, "b": 1, "s": 7, "num_query_groups": None}, 2, "cohere"),
    "qwen3 t=2: q_norm and k_norm on this rank's heads of head_dim (replicated_with_grad_allreduce)":
        (LLAMA | {"attention": "eager", "dropout": 0.0, "num_query_groups": 2, "kv_channels": 16,
                  "qk_layernorm": True}, 2, "qwen3"),
}


@pytest.mark.parametrize("knobs, t, family", TP_CASES.values(), ids=TP_CASES.keys())
def test_under_its_own_tp_plan_the_layer_keeps_exactly_what_the_rules_predict(one_thread, knobs, t, family):
    (rows,) = _tp_rows(knobs, t, family)
    assert _differences(rows) == []
    assert all(row.measured > 0 for row in rows)


def test_under_tp_the_colwise_inputs_are_whole_and_the_rest_is_split(one_thread):
    (rows,) = _tp_rows(LLAMA | {"attention": "flash", "dropout": 0.0, "num_query_groups": 2}, 2)
    shapes = {row.name: row.measured_shape for row in rows}
    b, s, h, a = (SIZES[k] for k in "bsha")
    assert shapes["attention/qkv_in"] == shapes["mlp/fc1_in"] == shapes["ln1/normed"] == (b, s, h)
    assert shapes["attention/q"] == (b, a // 2, s, h // a)
    assert shapes["attention/k"] == (b, 1, s, h // a)
    assert shapes["mlp/fc2_in"] == (b, s, SIZES["ffn_hidden_size"] // 2)


@pytest.mark.procs
def test_two_gloo_ranks_each_keep_what_rank_zero_of_the_fake_group_keeps():
    knobs = LLAMA | {"attention": "eager", "dropout": 0.0, "num_query_groups": 2}
    ranks = _tp_rows(knobs, 2, mode="spawn")
    assert [_differences(rows) for rows in ranks] == [[], []]
    assert ranks[0] == ranks[1] == _tp_rows(knobs, 2)[0]


@pytest.mark.parametrize("knobs, words", [
    (LLAMA, "does not run tp-sp .*in any model: transformers has no sequence parallelism"),
    (GPT2, "does not run tp .*GPT2Config has no base_model_tp_plan"),
    (NEOX, "does not run tp .*GPT-NeoX .*has not measured GPTNeoXConfig's base_model_tp_plan"),
    (BLOOM, "does not run tp .*for BLOOM .*BloomConfig has no base_model_tp_plan"),
    (FALCON | {"num_query_groups": None}, "does not run tp .*for Falcon .*FalconConfig has no base_model_tp_plan"),
    (FALCON40, "does not run tp .*for Falcon .*FalconConfig has no base_model_tp_plan"),
    (LLAMA | MLA | {"attention": "eager"}, "does not run tp .*with latent attention .*shards no attention"),
    (COHERE | {"qk_layernorm": True}, "does not run tp .*for Cohere with use_qk_norm .*names no rule for q_norm"),
])
def test_what_transformers_does_not_lay_out_is_refused_with_the_library_s_reason(knobs, words):
    strategy = "tp-sp" if "tp-sp" in words else "tp"
    with pytest.raises(ConfigError, match=words):
        estimate(build_config(SIZES | knobs | {"t": 2}), STRATEGIES[strategy])


def test_coheres_own_tp_plan_fails_on_its_qk_norms_as_the_refusal_says(one_thread):
    """The refusal of tp with use_qk_norm is transformers' own failure: its plan splits q_proj's heads, and q_norm's
    whole (a, d) weight then meets a/t heads in CohereLayerNorm's product."""
    config = build_config(SIZES | COHERE | {"attention": "eager", "dropout": 0.0, "qk_layernorm": True, "t": 2})
    with pytest.raises(RuntimeError, match="must match the size of tensor"):
        run(runner.run_layer, (config, STRATEGIES["tp"]), mode="fake", t=2)
