"""The tape (memcalc.sizing.timeline.tape): a moment keeps its bytes per category and its place in the tape's log,
not a copy of what is live, and reads back exactly what was live when it was marked, however the tape changed after."""

import pytest

from memcalc.sizing.timeline.tape import (
    ACTIVATIONS, CATEGORIES, GRADIENTS, PARAMETERS, TEMPORARIES, Live, Replays, Tape,
)


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


def _walk(tape: Tape) -> None:
    """A walk to trace: a temporary and an activation made, a moment at each, and the temporary freed."""
    tape.add("t", TEMPORARIES, 5, "a temporary")
    tape.mark("backward", "a", "t made")
    tape.add("a", ACTIVATIONS, 3, "an activation")
    tape.mark("backward", "a", "a made")
    tape.drop("t")


def test_a_replayed_walk_makes_the_moments_tensors_and_log_its_walk_would_on_top_of_what_is_live_now():
    replayed, walked = Tape(), Tape()
    for tape in (replayed, walked):
        tape.add("w", PARAMETERS, 100, "a weight")
        tape.mark("steady", "", "between steps")
    trace = replayed.traced(lambda: _walk(replayed))
    _walk(walked)
    for tape in (replayed, walked):
        tape.rename_all({"a": "first/a"})  # the walk's own names free again, as a pipeline's micro-batches do
        tape.add("g", GRADIENTS, 7, "a gradient")
        tape.mark("backward", "", "a gradient made")
    replayed.replay(trace)
    _walk(walked)
    moments, expected = replayed.moments, tuple(walked.moments)
    assert tuple(moments) == expected and len(moments) == len(expected) == 6
    assert [moments[i] for i in range(-6, 6)] == [*expected, *expected]
    assert moments[1:-1] == expected[1:-1] and moments[::-2] == expected[::-2]
    assert [(m.at, [x.name for x in m.live]) for m in moments] == [(m.at, [x.name for x in m.live]) for m in expected]
    assert replayed.live.log == walked.live.log and dict(replayed.live) == dict(walked.live)
    assert replayed.live.totals == walked.live.totals
    with pytest.raises(IndexError):
        moments[6]


def test_the_peak_is_the_first_moment_with_the_most_bytes_whether_marked_or_replayed():
    tape = Tape()
    trace = tape.traced(lambda: _walk(tape))  # 5 and 8 bytes
    tape.rename_all({"a": "first/a"})
    tape.replay(trace)  # 8 and 11 on top of first/a
    tape.rename_all({"a": "second/a"})
    tape.drop("first/a")
    tape.replay(trace)  # 8 and 11 again
    tape.add("x", ACTIVATIONS, 5, "as many bytes as the peaks above")
    tape.mark("forward", "", "x made")  # 11 again
    moments = tape.moments
    assert [m.bytes for m in moments] == [5, 8, 8, 11, 8, 11, 11]
    assert moments.peak().at == moments[3].at and moments.peak() == moments[3]


def _layer(tape: Tape, module: str) -> int:
    """A layer's walk in `module`: a moment in it and one below it; what it left live, in bytes."""
    tape.add("t", TEMPORARIES, 5, "a temporary")
    tape.mark("backward", module, "t made")
    tape.add("a", ACTIVATIONS, 3, "an activation")
    tape.mark("backward", f"{module}.mlp", "a made")
    tape.drop("t")
    return tape.live["a"].bytes


def test_a_walk_replayed_in_another_module_makes_what_walking_it_there_would_and_returns_the_same():
    replayed, walked = Tape(), Tape()
    replays = Replays(replayed)
    for i in range(3):
        module = f"layers.{i}"
        assert replays.run("layer", ("t", "a"), module, lambda: _layer(replayed, module)) == _layer(walked, module)
        for tape in (replayed, walked):
            tape.rename("a", f"{module}/a")
    assert len(replays.done) == 1  # walked once, replayed twice
    assert tuple(replayed.moments) == tuple(walked.moments)
    assert [m.where for m in replayed.moments] == ["layers.0", "layers.0.mlp", "layers.1", "layers.1.mlp", "layers.2",
                                                   "layers.2.mlp"]
    assert replayed.live.log == walked.live.log and replayed.moments.peak() == walked.moments.peak()


def test_a_walk_that_finds_other_tensors_under_its_names_is_walked_not_replayed():
    tape = Tape()
    replays = Replays(tape)
    replays.run("layer", ("t", "a"), "layers.0", lambda: _layer(tape, "layers.0"))
    with pytest.raises(AssertionError, match="a is live twice"):  # its "a" still live: walked again, and refused
        replays.run("layer", ("t", "a"), "layers.1", lambda: _layer(tape, "layers.1"))


def test_a_replayed_moment_outside_the_module_it_was_traced_in_is_refused():
    tape = Tape()
    trace = tape.traced(lambda: _layer(tape, "layers.1"))
    tape.rename("a", "first/a")
    with pytest.raises(AssertionError, match="layers.1 is not in layers.10"):  # a path, not a prefix
        tape.replay(trace, ("layers.10", "layers.2"))


def test_the_live_tensors_refuse_a_change_that_would_bypass_their_totals_and_log():
    tape = Tape()
    tape.add("x", ACTIVATIONS, 4, "a tensor")
    for change in (lambda live: live.update({}), lambda live: live.setdefault("y", None), lambda live: live.clear(),
                   lambda live: live.__delitem__("x")):
        with pytest.raises(TypeError, match="only by set and pop"):
            change(tape.live)
