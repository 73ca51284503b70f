"""transformers' own layers keep, tensor by tensor, what memcalc's hf rules predict (bytes and shape)."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch  # noqa: E402

from memcalc.config.schema import build_config  # noqa: E402
from memcalc.errors import ConfigError  # noqa: E402
from memcalc.model.evaluate import estimate  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.group import single  # noqa: E402
from memcalc.probe.libs import hf as runner  # noqa: E402
from memcalc.probe.libs.hf_shim import cuda_like_dropout  # noqa: E402
from memcalc.probe.measure import compare  # noqa: E402
from memcalc.probe.recorder import SavedTensorRecorder  # noqa: E402

SIZES = {"b": 2, "s": 8, "h": 32, "a": 4, "ffn_hidden_size": 48, "impl": "hf"}
LLAMA = {"norm": "rmsnorm", "mlp": "swiglu"}
GPT2 = {"norm": "layernorm", "mlp": "gelu"}  # transformers' own defaults are Llama's
MLA = {"kv_lora_rank": 24, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 12, "v_head_dim": 10}


def _rows(knobs: dict, family: str | None = None):
    config = build_config(SIZES | knobs)
    saved = runner.record_layer(single("cpu"), config, STRATEGIES["none"], family=family)
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
    "qwen2's qkv bias keeps nothing more": (LLAMA | {"attention": "flash", "dropout": 0.0, "add_qkv_bias": True}, None),
    "llama fp32: the softmax cast is a no-op, one storage": (LLAMA | {"attention": "eager", "dtype": "fp32"}, None),
    "gpt2 eager gelu_new: four f-wide tensors, resid and mlp dropout masks":
        (GPT2 | {"mlp": "gelu_tanh", "attention": "eager", "dropout": 0.1}, None),
    "gpt2 sdpa gelu: q, k, v as one c_attn storage, split into ledger rows":
        (GPT2 | {"mlp": "gelu", "attention": "flash", "dropout": 0.0}, None),
    "gradient checkpointing keeps the layer input only": (LLAMA | {"recompute": "full", "dropout": 0.1}, None),
    "deepseek-v3 latent attention, eager: fp32 latent norms, up projections' inputs, one rope table pair":
        (LLAMA | MLA | {"attention": "eager", "dropout": 0.0}, None),
    "deepseek-v2-lite latent attention, no query latent, with dropout":
        (LLAMA | MLA | {"q_lora_rank": None, "attention": "eager", "dropout": 0.1}, None),
}


@pytest.mark.parametrize("knobs, family", CASES.values(), ids=CASES.keys())
def test_the_layer_keeps_exactly_what_the_rules_predict(knobs, family):
    rows = _rows(knobs, family)
    assert _differences(rows) == []
    assert all(row.measured > 0 for row in rows)  # every predicted tensor was found, none unlabelled


def test_gpt2_sdpa_predicts_q_k_v_as_a_third_of_the_c_attn_storage_each():
    rows = {row.name: row for row in _rows(GPT2 | {"mlp": "gelu", "attention": "flash", "dropout": 0.0})}
    b, s, h, a = (SIZES[k] for k in "bsha")
    assert [rows[n].measured for n in ("attention/q", "attention/k", "attention/v")] == [2 * b * s * h] * 3
    assert rows["attention/q"].measured_shape == (b, a, s, h // a)


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
])
def test_knobs_no_transformers_layer_runs_are_refused(knobs, words):
    with pytest.raises(ConfigError, match=words):
        estimate(build_config(SIZES | knobs), STRATEGIES["none"])


def test_hf_runs_no_tensor_parallelism():
    with pytest.raises(ConfigError, match="does not run tp"):
        estimate(build_config(SIZES | LLAMA | {"t": 2}), STRATEGIES["tp"])
