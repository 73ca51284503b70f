"""torchtitan's pipeline in the step timeline (memcalc.sizing.timeline.torchtitan_pp): torch's Schedule1F1B order,
what a stage keeps between steps and to the step's end, and what is refused. Against MemTracker:
tests/probe/libs/test_torchtitan_pp.py."""

import pytest

from memcalc.errors import ConfigError
from memcalc.model.knobs import Accounting
from memcalc.model.strategy import STRATEGIES
from memcalc.sizing.timeline import ACTIVATIONS, timeline
from memcalc.sizing.timeline.torchtitan_pp import schedule

from tests.helpers import TORCHTITAN_LLAMA3 as LLAMA3, make_config

CPU = Accounting(exact=True, device="cpu")


def _timeline(stage, **changes):
    return timeline(make_config(LLAMA3, pp=2, **changes), STRATEGIES["none"], CPU, stage)


def test_1f1b_runs_pp_minus_rank_forwards_then_a_backward_before_each_further_forward():
    assert schedule(3, 2, 0) == [(True, 0), (True, 1), (False, 0), (True, 2), (False, 1), (False, 2)]
    assert schedule(3, 2, 1) == [(True, 0), (False, 0), (True, 1), (False, 1), (True, 2), (False, 2)]


@pytest.mark.parametrize("stage", ["first", "last"])
def test_between_steps_a_stage_keeps_one_receive_buffer_per_micro_batch(stage):
    config = make_config(LLAMA3, pp=2, num_microbatches=3)
    steady = _timeline(stage, num_microbatches=3).steady
    assert steady.by_category()[ACTIVATIONS] == 3 * config.b * config.s * config.h * 2


def test_the_last_stage_keeps_each_micro_batchs_loss_to_the_optimizer():
    live = {x.name for x in _timeline("last", num_microbatches=3).moments[-1].live}
    assert {f"micro-batch {j}/loss/value" for j in range(3)} <= live


def test_more_walked_layers_than_the_walk_takes_are_refused_counting_every_micro_batch():
    with pytest.raises(ConfigError, match="L/pp = 2/2 is 1, times 600 micro-batches"):
        _timeline("first", num_microbatches=600)
