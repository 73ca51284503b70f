"""memcalc's torchtitan TP plan (memcalc.model.impls.torchtitan.tp_plan) is set_llama3_sharding_config's own: each
module it names carries the ShardingConfig torchtitan gives its style, with sequence parallelism and without (and
set_deepseek_v3_sharding_config's, for its latent attention)."""

from operator import attrgetter

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchtitan")

from memcalc.config.schema import build_config  # noqa: E402
from memcalc.model.impls import IMPLEMENTATIONS  # noqa: E402
from memcalc.model.tp_plan import Style  # noqa: E402
from memcalc.probe.libs import torchtitan as runner  # noqa: E402  (its shim first: torchtitan imports triton)
from torchtitan.models.common.decoder_sharding import colwise_config, norm_config, rowwise_config  # noqa: E402

BLOCK = {"impl": "torchtitan", "b": 2, "s": 8, "h": 64, "a": 4, "t": 2, "recompute": "none"}


# Llama3's, with two K/V groups; DeepSeek-V3's latent attention (set_deepseek_v3_sharding_config): without a query
# latent its wq, with one its wq_b
MLA = {"kv_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 12}


@pytest.mark.parametrize("attention", [{"num_query_groups": 2}, MLA, MLA | {"q_lora_rank": 16}],
                         ids=["llama3", "deepseek-v3", "deepseek-v3 with a query latent"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_each_module_of_the_plan_has_the_sharding_config_torchtitan_gives_its_style(sequence_parallel, attention):
    config = build_config(BLOCK | attention)
    block = runner.block_config(config, sequence_parallel)
    sp = sequence_parallel
    torchtitans = {Style.COLWISE_KEEPS_INPUT: colwise_config(), Style.SEQUENCE: norm_config(enable_sp=sp),
                   Style.ROWWISE: rowwise_config(output_sp=sp)}
    rules = IMPLEMENTATIONS["torchtitan"].tp_plan(config).rules
    assert [attrgetter(r.module)(block).sharding_config == torchtitans[r.style] for r in rules] == [True] * len(rules)
