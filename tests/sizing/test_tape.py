"""The tape (memcalc.sizing.timeline.tape): a moment keeps its bytes per category and its place in the tape's log,
not a copy of what is live, and reads back exactly what was live when it was marked, however the tape changed after."""

import pytest

from memcalc.sizing.timeline.tape import ACTIVATIONS, CATEGORIES, GRADIENTS, PARAMETERS, TEMPORARIES, Live, Tape


def _tape() -> Tape:
    tape = Tape()
    tape.add("w", PARAMETERS, 100, "a weight")
    tape.add("x", ACTIVATIONS, 10, "an activation")
    tape.mark("forward", "a", "one")
    tape.add("g", TEMPORARIES, 7, "a gradient")
    tape.rename("x", "y")
    tape.live["g"] = Live("g", GRADIENTS, 7, "filed as a gradient")
    tape.mark("backward", "a", "two")
    tape.drop("w", "y", "not live")
    tape.mark("backward", "b", "three")
    return tape


def test_each_moment_reads_back_what_was_live_when_it_was_marked_in_the_tapes_order():
    one, two, three = _tape().moments
    assert [x.name for x in one.live] == ["w", "x"]
    assert [(x.name, x.category) for x in two.live] == [("w", PARAMETERS), ("g", GRADIENTS), ("y", ACTIVATIONS)]
    assert [x.name for x in three.live] == ["g"]


def test_a_moments_bytes_per_category_are_its_live_tensors_summed():
    for moment in _tape().moments:
        summed = dict.fromkeys(CATEGORIES, 0)
        for x in moment.live:
            summed[x.category] += x.bytes
        assert moment.by_category() == summed and moment.bytes == sum(summed.values())


def test_moments_share_one_log_instead_of_copying_the_live_set():
    tape = _tape()
    assert len({id(m.log) for m in tape.moments}) == 1
    assert [m.at for m in tape.moments] == sorted(m.at for m in tape.moments)



def test_the_live_tensors_refuse_a_change_that_would_bypass_their_totals_and_log():
    tape = Tape()
    tape.add("x", ACTIVATIONS, 4, "a tensor")
    for change in (lambda live: live.update({}), lambda live: live.setdefault("y", None), lambda live: live.clear(),
                   lambda live: live.__delitem__("x")):
        with pytest.raises(TypeError, match="only by set and pop"):
            change(tape.live)
