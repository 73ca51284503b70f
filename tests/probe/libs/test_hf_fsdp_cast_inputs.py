"""FSDP2's mixed precision casts the floating tensors each sharded decoder layer is called with: OLMo's and OLMo 2's
model hand their layers fp32 RoPE tables, so under fully_shard every layer keeps its own bf16 copy of cos and sin
where an unsharded bf16 model keeps the one fp32 pair. What transformers' layers keep for backward (every storage
saved inside a decoder layer, its parameters aside), under torch's fully_shard on the fake group and without it, is
the ledger's `estimate --exact` for all L layers, with and without dp_shard."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from memcalc.model.evaluate import estimate  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.launch import run_fake  # noqa: E402

from tests.helpers import LLAMA_HF, make_config  # noqa: E402

CPU = Accounting(exact=True, device="cpu")
OLMO = LLAMA_HF | {"family": "olmo", "norm": "layernorm_np", "attention": "flash", "L": 5}
OLMO2 = LLAMA_HF | {"family": "olmo2", "norm": "rmsnorm_fp32w", "post_norm": True, "qk_layernorm": True,
                    "attention": "flash", "L": 5}
CASES = {
    "olmo b=2 s=24": OLMO,
    "olmo b=1 s=13 eager": OLMO | {"b": 1, "s": 13, "attention": "eager", "num_query_groups": 8},
    "olmo2 b=3 s=7": OLMO2 | {"b": 3, "s": 7},
}


def _kept_by_layers(tp, config, sharded: bool) -> int:
    """Bytes of the storages autograd saves inside the decoder layers in one forward (each storage once; the layer's
    own parameters, which FSDP2 unshards into storages it reuses, left out)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from memcalc.probe.libs.hf_step import causal_lm
    from memcalc.probe.step import batch

    torch.manual_seed(0)
    model, loss = causal_lm(config, None, torch.float32 if sharded else torch.bfloat16, tp.device)
    if sharded:  # fp32 parameters, computed in bf16 (memcalc.probe.libs.hf_fsdp's layout)
        mesh, policy = init_device_mesh("cpu", (tp.size,)), MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    saved, own = {}, []  # own: the running layer's parameters' storages, or empty outside a layer

    def enter(layer, _args):
        own.append({p.untyped_storage().data_ptr() for p in layer.parameters()})

    def leave(*_):
        own.pop()

    for layer in model.model.layers:  # registered after fully_shard's: they run with the layer's parameters unsharded
        layer.register_forward_pre_hook(enter)
        layer.register_forward_hook(leave)

    def pack(x):
        storage = x.untyped_storage()
        if own and storage.data_ptr() not in own[-1]:
            saved.setdefault(storage.data_ptr(), storage.nbytes())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss(*batch(config, tp.device))
    return sum(saved.values())


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("dp_shard", [None, 2])
def test_what_the_layers_keep_under_fully_shard_is_the_ledgers_with_a_cast_table_pair_per_layer(
        one_thread, name, dp_shard):
    config = make_config(CASES[name], dp_shard=dp_shard)
    measured = run_fake(_kept_by_layers, (config, dp_shard is not None), t=2)
    assert measured == estimate(config, STRATEGIES["none"], CPU).total_bytes


def test_fsdp2_trades_the_one_fp32_table_pair_for_a_bf16_pair_in_every_layer():
    unsharded, sharded = (estimate(make_config(OLMO, dp_shard=n), STRATEGIES["none"], CPU) for n in (None, 2))
    pair = 2 * OLMO["s"] * (OLMO["h"] // OLMO["a"])  # cos and sin: (s, d) each
    assert sharded.total_bytes - unsharded.total_bytes == OLMO["L"] * 2 * pair - 4 * pair
    fp32 = estimate(make_config(OLMO, dp_shard=2, dtype="fp32"), STRATEGIES["none"], CPU)
    assert fp32.total_bytes == estimate(make_config(OLMO, dtype="fp32"), STRATEGIES["none"], CPU).total_bytes
