"""The generic walk (memcalc.sizing.timeline.walk): what autograd's order implies for any list of ops, pinned on a
two-op layer drawn by hand: a tensor two ops save goes only when the earlier op's backward returns; an op's saved
tensors go when its node returns, before a step after it; a weight's gradient goes when the step that hands it
over is done; forward makes activations and backward temporaries."""

from memcalc.model.ledger import Dim, Kind, Region, SavedTensor
from memcalc.sizing.timeline import ACTIVATIONS, TEMPORARIES
from memcalc.sizing.timeline.tape import Tape
from memcalc.sizing.timeline.walk import Made, Op, Step, Walk, kept

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
