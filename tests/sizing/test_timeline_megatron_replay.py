"""Megatron's layers in the step timeline are walked once a kind and replayed (`memcalc.sizing.timeline.tape.Replays`):
a replayed layer must make what walking it would, and a layer's walk may change the tape only under the names its
replay is keyed on."""

import pytest

from memcalc.model.knobs import Accounting
from memcalc.model.strategy import STRATEGIES
from memcalc.sizing.timeline import timelines
from memcalc.sizing.timeline.tape import Replays

from tests.helpers import TINY, make_config

MEGATRON = TINY | {"impl": "megatron", "L": 4, "vocab_size": 256, "add_bias_linear": False, "t": 2}
MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32}
CASES = [
    ({}, "cpu", "tp"),
    ({"recompute": "full"}, "cuda", "tp-sp"),
    ({"recompute": "selective"}, "cpu", "none"),
    (MOE | {"moe_first_dense_layers": 1}, "cuda", "tp-sp"),  # megatron-core's experts under tp need SP
    (MOE | {"moe_layer_freq": 2, "recompute": "full"}, "cpu", "tp-sp"),
    (MOE | {"kv_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "q_lora_rank": 16,
            "moe_first_dense_layers": 1}, "cpu", "tp-sp"),
    ({"pp": 2, "num_microbatches": 4}, "cuda", "tp"),
    ({"pp": 2, "vpp": 2, "num_microbatches": 4, "L": 8}, "cpu", "tp-sp"),
]


def _walked(config, strategy, device):
    return timelines(config, STRATEGIES[strategy], Accounting(exact=True, device=device))


def _readings(stages):
    """Every moment of every stage: where, what, its totals and what is live then, by name and bytes."""
    return [[(x.phase, x.where, x.what, x.totals, sorted((y.name, y.bytes) for y in x.live)) for x in stage.moments]
            for stage in stages]


@pytest.mark.parametrize("changes, device, strategy", CASES, ids=str)
def test_each_layer_replayed_makes_the_moments_and_tensors_its_own_walk_would(monkeypatch, changes, device, strategy):
    config = make_config(MEGATRON, **changes)
    replayed = _readings(_walked(config, strategy, device))
    run = Replays.run

    def walk_anew(self, kind, names, module, walk):
        self.done.clear()  # nothing to replay
        return run(self, kind, names, module, walk)
    monkeypatch.setattr(Replays, "run", walk_anew)
    assert replayed == _readings(_walked(config, strategy, device))


@pytest.mark.parametrize("changes, device, strategy", CASES, ids=str)
def test_a_layers_walk_changes_the_tape_only_under_the_names_its_replay_is_keyed_on(monkeypatch, changes, device,
                                                                                  strategy):
    """The replay is exact only if a walk changes no tensor outside its `names`: every change its trace logs (a tensor
    made, freed or renamed) is under one of them."""
    run, outside, walks = Replays.run, set(), []

    def walk_anew(self, kind, names, module, walk):
        self.done.clear()
        result = run(self, kind, names, module, walk)
        ((trace, _, _),) = self.done.values()
        outside.update({x if isinstance(x, str) else x.name for x in trace.log} - set(names))
        walks.append(kind)
        return result
    monkeypatch.setattr(Replays, "run", walk_anew)
    _walked(make_config(MEGATRON, **changes), strategy, device)
    assert walks and not outside
