"""The generic walk (memcalc.sizing.timeline.walk): what autograd's order implies for any list of ops, pinned on a
two-op layer drawn by hand: a tensor two ops save goes only when the earlier op's backward returns; an op's saved
tensors go when its node returns, before a step after it; a weight's gradient goes when the step that hands it
over is done; forward makes activations and backward temporaries. Under a checkpoint (torch.utils.checkpoint), on a
three-op region: forward keeps its input and the cached outputs alone, the rerun comes at the first op that keeps
something, and the input goes with the last tensor the rerun kept."""

from memcalc.model.ledger import Dim, Kind, Region, SavedTensor
from memcalc.sizing.timeline import ACTIVATIONS, TEMPORARIES
from memcalc.sizing.timeline.tape import Tape
from memcalc.sizing.timeline.torch_ops import linear
from memcalc.sizing.timeline.walk import Checkpoint, Made, Op, Step, Walk, kept

X = SavedTensor("x", "both linears", (Dim.B, Dim.S, Dim.H), Kind.ACTIVATION, Region.REPLICATED, "dW = X^T dY")
SAVED = {"x": 100}


def _layer() -> tuple[Op, ...]:
    """Two linears on one kept input (as w1 and w3), the first summing its dX into the second's."""
    first = Op("w1", forward=(Step("x", (kept("l", X),)), Step("w1 x", (Made("l/y1", 10, "out"),))),
               backward=(Step("GEMMs", (Made("g/w1", 7, "dW"), Made("g/dx1", 100, "dX")), returns=True),
                         Step("sum", (Made("g/dx", 100, "sum"),), frees=("g/dx1", "g/dx3"), hands_over=("g/w1",))),
               saves=(X,))
    second = Op("w3", forward=(Step("w3 x", (Made("l/y3", 10, "out"),)),),
                backward=(Step("GEMMs", (Made("g/w3", 7, "dW"), Made("g/dx3", 100, "dX")), hands_over=("g/w3",)),),
                saves=(X,))
    return (first, second)


def _walked() -> tuple[Tape, list[str]]:
    tape, handed = Tape(), []
    walk = Walk(tape, "l", "layers.0", SAVED, lambda where, name, nbytes: (handed.append(where), tape.drop(name)))
    walk.forward(_layer())
    walk.backward(_layer())
    return tape, handed


def test_a_tensor_two_ops_save_goes_when_the_earlier_ops_node_returns_before_its_sum():
    tape, _ = _walked()
    second, first_gemms, first_sum = tape.moments[-3:]
    assert {x.name for x in second.live} >= {"l/x", "g/dx3"}  # w3's backward ran: x is still w1's
    assert "l/x" in {x.name for x in first_gemms.live}
    assert "l/x" not in {x.name for x in first_sum.live}  # w1's node returned: x went before the sum


def test_a_weight_gradient_is_handed_over_after_the_step_that_names_it_and_not_before():
    tape, handed = _walked()
    assert handed == ["layers.0.w3", "layers.0.w1"]
    assert "g/w1" in {x.name for x in tape.moments[-1].live}  # the sum's moment: w1's dW still waits
    assert not tape.live.keys() - {"l/y1", "l/y3", "g/dx"}


def test_forward_makes_activations_sized_by_the_ledger_and_backward_temporaries():
    tape, _ = _walked()
    x = next(x for x in tape.moments[0].live if x.name == "l/x")
    assert (x.category, x.bytes) == (ACTIVATIONS, SAVED["x"])
    assert {x.category for x in tape.moments[-1].live if x.name.startswith("g/")} == {TEMPORARIES}
    assert [m.where for m in tape.moments] == ["layers.0.w1"] * 2 + ["layers.0.w3"] * 2 + ["layers.0.w1"] * 2


def test_walked_backward_alone_a_tensor_two_ops_save_still_goes_when_the_earlier_ops_node_returns():
    """Full recomputation walks a layer's backward without its forward: the first op keeping each tensor is found
    there."""
    tape = Tape()
    tape.add("l/x", ACTIVATIONS, SAVED["x"], "made before, as a checkpoint's rerun makes it")
    Walk(tape, "l", "layers.0", SAVED, lambda where, name, nbytes: tape.drop(name)).backward(_layer())
    second, first_gemms, first_sum = tape.moments[-3:]
    assert "l/x" in {x.name for x in first_gemms.live}
    assert "l/x" not in {x.name for x in first_sum.live}


def test_a_made_tensor_that_names_its_category_is_filed_there_and_not_under_the_phase():
    tape = Tape()
    op = Op("w", forward=(), backward=(Step("rerun", (Made("l/y", 10, "rerun", category=ACTIVATIONS),
                                                      Made("l/z", 10, "rerun")),),))
    Walk(tape, "l", "layers.0", SAVED, lambda where, name, nbytes: None).backward((op,))
    assert {x.name: x.category for x in tape.moments[-1].live} == {"l/y": ACTIVATIONS, "l/z": TEMPORARIES}


# -- under a checkpoint: a region whose input "in" feeds op a (x, kept), op b.c (y = W x, keeping x) and a residual sum

def _region() -> tuple[Op, ...]:
    a = Op("a", forward=(Step("x = f(in)", (kept("l", X),)),),
           backward=(Step("a's backward", (Made("g/in", 100, "dX"),), frees=("g/x",)),))
    c = Op("b.c", forward=(Step("y = W x", (Made("l/y", 10, "out"),), reads_last=("l/x",)),),
           backward=(Step("GEMMs", (Made("g/x", 100, "dX"),), frees=("g/y",), reads_last=("l/x",)),), saves=(X,))
    return (a, c, Op("", forward=(Step("in + y", (Made("out", 10, "the output"),), frees=("l/y", "in")),), backward=()))


def _checkpointed(cached: frozenset[str] = frozenset()) -> tuple[Tape, int]:
    """The region walked under a checkpoint; the index of its first backward moment."""
    tape = Tape()
    tape.add("in", ACTIVATIONS, 50, "the region's input")
    walk = Walk(tape, "l", "layers.0", SAVED, lambda where, name, nbytes: None, Checkpoint("in", cached))
    walk.forward(_region())
    tape.drop("out")
    tape.add("g/y", TEMPORARIES, 10, "dY")
    first = len(tape.moments)
    walk.backward(_region())
    return tape, first


def test_under_a_checkpoint_forward_keeps_the_input_alone_and_a_kept_tensor_goes_after_its_last_reader():
    tape, first = _checkpointed()
    assert [sorted(x.name for x in m.live) for m in tape.moments[:first]] == [
        ["in", "l/x"], ["in", "l/x", "l/y"], ["in", "l/y", "out"]]


def test_the_rerun_at_the_first_op_that_keeps_something_makes_activations_read_in_backward_at_the_trigger():
    tape, first = _checkpointed()
    rerun = tape.moments[first:first + 3]
    assert [(m.phase, m.where, m.what) for m in rerun] == [
        ("backward", "layers.0.a", "x = f(in)"), ("backward", "layers.0.b.c", "y = W x"),
        ("backward", "layers.0.b.c", "in + y")]  # the residual sum runs in the region, read at b.c, still active
    assert {x.category for m in rerun for x in m.live if x.name.startswith("l/")} == {ACTIVATIONS}
    assert "out" not in {x.name for x in tape.moments[first + 3].live}  # what the rerun returned went at its end


def test_the_rerun_tensors_go_after_their_last_reader_and_the_input_with_the_last_of_them():
    tape, first = _checkpointed()
    gemms, a = tape.moments[first + 3:]
    assert {"in", "l/x"} <= {x.name for x in gemms.live}
    assert not {"in", "l/x"} & {x.name for x in a.live}
    assert not tape.live.keys() - {"g/in", "g/x"}


def test_a_cached_output_outlives_its_frees_in_forward_and_the_rerun_takes_it_instead_of_making_it():
    tape, first = _checkpointed(frozenset({"l/y"}))
    assert "l/y" in {x.name for x in tape.moments[first].live}  # kept from forward to the rerun
    assert [m.what for m in tape.moments[first:first + 2]] == ["x = f(in)", "in + y"]


def test_a_biased_linear_hands_its_biass_gradient_over_before_its_weights():
    """addmm's node passes the bias's gradient straight to its accumulator, which autograd runs before the weight's
    (behind t()'s backward, or GPT-2's Conv1D's, after the bias's): the order ZeRO's reduce bucket fills in
    (transformers' Qwen2 q, k, v and GPT-2's Conv1D, read from their post-accumulate-grad hooks)."""
    tape, handed = Tape(), []
    walk = Walk(tape, "l", "layers.0", SAVED, lambda where, name, nbytes: (handed.append(name), tape.drop(name)))
    op = linear("q", X, Made("l/q", 10, "out"), 7, "g/dx", 100, "", bias=3)
    walk.forward((op,))
    walk.backward((op,))
    assert handed == ["grad/q bias", "grad/q weight"]
