"""MemTracker's reading after every op of one training step, and the check that a step timeline's moments are
among those readings, in order (tests/probe/test_step.py, tests/probe/libs/test_hf_step.py)."""

from memcalc.probe.step import MomentTracker, Trainer, categories
from memcalc.sizing.timeline import Moment


def reading_every_op(tracker: type[MomentTracker], read=categories) -> type[MomentTracker]:
    """`tracker` that appends where it is and its bytes per category (`read` of its snapshot) to `readings` after
    each op."""

    class AfterEveryOp(tracker):
        readings: list[tuple[str, dict[str, int]]]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.readings.append((self.where(), {c: n for c, n in read(self.get_tracker_snapshot()).items() if n}))
            return out

    return AfterEveryOp


def readings_after_every_op(trainer: Trainer) -> list[tuple[str, dict[str, int]]]:
    """Where (`MomentTracker.where`) and the bytes per category after each op of one step of a warmed-up trainer."""
    tracker = reading_every_op(MomentTracker)()
    tracker.readings = []
    trainer.register(tracker)
    with tracker:
        trainer.step()
    return tracker.readings


def assert_moments_in_order(moments: tuple[Moment, ...], readings: list[tuple[str, dict[str, int]]],
                            places: bool = True) -> None:
    """Each moment's bytes per category (and, with `places`, its phase and module) are those after some op, the
    ops in the moments' order."""
    position = 0
    for moment in moments:
        expected = {c: n for c, n in moment.by_category().items() if n}
        where = f"{moment.phase} {moment.where}".strip()
        found = next((i for i in range(position, len(readings))
                      if readings[i][1] == expected and (readings[i][0] == where or not places)), None)
        assert found is not None, f"{moment.label()}: {expected} is not among the readings after op {position}"
        position = found
