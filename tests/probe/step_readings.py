"""MemTracker's reading after every op of one training step, and the check that a step timeline's moments are
among those readings, in order (tests/probe/test_step.py, tests/probe/libs/test_hf_step.py)."""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest

from memcalc.probe import step
from memcalc.probe.step import MEASURED_CATEGORIES, MomentTracker, Trainer, categories
from memcalc.sizing.timeline import Moment


def reading_every_op(tracker: type[MomentTracker], kinds: dict[str, str] = MEASURED_CATEGORIES
                     ) -> type[MomentTracker]:
    """`tracker` that appends where it is and its bytes per category (its snapshot read with `kinds`, the tracker's
    categories as the timeline's) to `readings` after each op."""

    class AfterEveryOp(tracker):
        readings: list[tuple[str, dict[str, int]]]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            read = categories(self.get_tracker_snapshot(), kinds)
            self.readings.append((self.where(), {c: n for c, n in read.items() if n}))
            return out

    return AfterEveryOp


def torchtitan_fsdp_readings(config, strategy: str, route: str | None = None) -> list[tuple[str, dict[str, int]]]:
    """FSDPMemTracker's reading after every op of one step of torchtitan's Llama3Model under its parallelize_llama, on
    rank 0 of dp_replicate*dp_shard*t (torchtitan's own meshes); with experts the router forced to `route`."""
    from memcalc.model.strategy import STRATEGIES
    from memcalc.probe.launch import run_fake
    from memcalc.probe.libs.fsdp_groups import GroupsMomentTracker
    from memcalc.probe.libs.hf_fsdp import FSDP_CATEGORIES
    from memcalc.probe.libs.torchtitan_step import data_parallel, warmed_up_sharded

    plan = STRATEGIES[strategy]

    def on_rank(tp):
        with data_parallel(tp, config, plan) as dims:
            trainer = warmed_up_sharded(tp, config, plan, dims, route)
            tracker = reading_every_op(GroupsMomentTracker, FSDP_CATEGORIES)(trainer.model, trainer.optimizer)
            tracker.readings = []
            with tracker:
                trainer.step()
            return tracker.readings

    return run_fake(on_rank, (), (config.dp_replicate or 1) * config.dp_shard * plan.weight_shards(config.t))


def readings_after_every_op(trainer: Trainer, tracker: type[MomentTracker] = MomentTracker
                            ) -> list[tuple[str, dict[str, int]]]:
    """Where (`MomentTracker.where`) and the bytes per category after each op of one step of a warmed-up trainer,
    under `tracker` (a library's MomentTracker)."""
    tracker = reading_every_op(tracker)()
    tracker.readings = []
    trainer.register(tracker)
    with tracker:
        trainer.step()
    return tracker.readings


@contextmanager
def readings_of_the_measured_step() -> Iterator[list[tuple[str, dict[str, int]]]]:
    """The readings after every op of the step `measure_step` measures inside the block: the MomentTracker
    `measure_trainer` makes records them, so one model built and stepped serves both the peak's check and the
    moments' (a second model, built and stepped only for its readings, cost a third of each such test). A measure that
    makes no MomentTracker leaves the list empty, where no moment is found."""
    readings: list[tuple[str, dict[str, int]]] = []

    def recording() -> MomentTracker:
        tracker = reading_every_op(MomentTracker)()
        tracker.readings = readings
        return tracker

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step, "MomentTracker", recording)
        yield readings


def assert_moments_in_order(moments: Sequence[Moment], readings: list[tuple[str, dict[str, int]]],
                            places: tuple[str, ...] = ("forward", "backward", "optimizer")) -> None:
    """Each moment's bytes per category (and, for a moment of one of the phases `places` names, its phase and module)
    are those after some op, the ops in the moments' order."""
    position = 0
    for moment in moments:
        expected = {c: n for c, n in moment.by_category().items() if n}
        where = f"{moment.phase} {moment.where}".strip()
        placed = moment.phase in places
        found = next((i for i in range(position, len(readings))
                      if readings[i][1] == expected and (readings[i][0] == where or not placed)), None)
        assert found is not None, f"{moment.label()}: {expected} is not among the readings after op {position}"
        position = found


def assert_step_exact(r) -> None:
    """`measure --step`'s comparison (a `StepComparison`): MemTracker peaks at the moment the timeline names, with its
    bytes in every category, at the peak and between steps."""
    assert r.measured.moment == r.predicted_moment, (r.measured.moment, r.predicted_moment, r.differences())
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()


def assert_step_exact_moment_by_moment(config, strategy: str, model: str, route: str | None = None) -> None:
    """MemTracker's step of `model` (the words `measure_step` names it by begin so): every moment the CPU's timeline
    names among its readings, in order; its peak at the moment named, each category there and the state between
    steps to the byte."""
    from memcalc.model.knobs import Accounting
    from memcalc.model.strategy import STRATEGIES
    from memcalc.sizing.timeline import timeline

    with readings_of_the_measured_step() as readings:
        (r,) = step.measure_step(config, [strategy], route=route)
    assert r.model.startswith(model)
    cpu = Accounting(exact=True, device="cpu")
    assert_moments_in_order(timeline(config, STRATEGIES[strategy], cpu).moments[1:-1], readings)
    assert_step_exact(r)


def torchtitan_pp_fsdp_readings(config, stage: str, route: str | None = None) -> list[tuple[str, dict[str, int]]]:
    """FSDPMemTracker's reading after every op of one step of torchtitan's pipeline stage `stage` under its
    parallelize_llama (FSDP2 over dp_shard; with experts its routers forced to `route`), on the stage's first rank of
    pp x dp_shard."""
    from memcalc.model.strategy import STRATEGIES
    from memcalc.probe.launch import run_fake
    from memcalc.probe.libs.hf_fsdp import FSDP_CATEGORIES, FsdpMomentTracker
    from memcalc.probe.libs.torchtitan_pp import sharded_pipeline_runtime, warmed_up_sharded_stage
    from memcalc.sizing.pipeline import stage_rank

    plan = STRATEGIES["none"]

    def on_rank(group):
        with sharded_pipeline_runtime(group, config, plan) as dims:
            trainer = warmed_up_sharded_stage(group, config, plan, dims, route)
            tracker = reading_every_op(FsdpMomentTracker, FSDP_CATEGORIES)(trainer.model, trainer.optimizer)
            tracker.readings = []
            trainer.register(tracker)
            with tracker:
                trainer.step()
            return tracker.readings

    world = config.pp * config.dp_shard
    return run_fake(on_rank, (), world, rank=stage_rank(stage, config.pp) * config.dp_shard)
