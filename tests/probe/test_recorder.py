"""The recorder counts what autograd keeps for backward: each storage once, at its full
size, parameters left out, under the name the code labelled it with."""

import pytest

torch = pytest.importorskip("torch")

from memcalc.model import ledger  # noqa: E402
from memcalc.errors import ProbeError  # noqa: E402
from memcalc.probe.recorder import SavedTensorRecorder, label  # noqa: E402


def _record(fn, *args, parameters=()):
    with SavedTensorRecorder(parameters) as recorder:
        out = fn(*args)
    return out, recorder.saved


def test_gelu_keeps_its_input_once_at_its_full_size():
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    _, saved = _record(torch.nn.functional.gelu, x)
    assert [(s.nbytes, s.shape, s.dtype) for s in saved] == [(4 * 8 * 2, (4, 8), "bfloat16")]


def test_a_storage_saved_by_two_ops_counts_once():
    x = torch.randn(4, 8, requires_grad=True)
    _, saved = _record(lambda x: torch.nn.functional.gelu(x) + torch.sigmoid(x) * 0 + x.sin(), x)
    # gelu and sin both keep x; sigmoid keeps its output (a second storage)
    assert sorted(s.nbytes for s in saved) == [4 * 8 * 4, 4 * 8 * 4]


def test_a_saved_view_counts_its_whole_storage():
    big = torch.randn(10, 8, requires_grad=True)
    _, saved = _record(lambda x: torch.nn.functional.gelu(x[:2]), big)
    assert [s.nbytes for s in saved] == [10 * 8 * 4]  # the slice keeps all 10 rows alive


def test_parameters_are_not_activations():
    linear = torch.nn.Linear(8, 16)
    x = torch.randn(3, 8, requires_grad=True)
    _, saved = _record(linear, x, parameters=linear.parameters())
    assert [s.nbytes for s in saved] == [3 * 8 * 4]  # the input; not the weight


def test_labelled_storages_carry_the_ledger_name_and_the_labelled_views_shape():
    def gelu_labelled(x):
        label(x.t(), ledger.GELU_IN)
        return torch.nn.functional.gelu(x)

    _, saved = _record(gelu_labelled, torch.randn(4, 8, requires_grad=True))
    assert [(s.name, s.shape) for s in saved] == [("mlp/gelu_in", (8, 4))]


def test_an_unlabelled_storage_is_reported_without_a_name():
    _, saved = _record(torch.softmax, torch.randn(4, 8, requires_grad=True), -1)
    assert [(s.name, s.shape) for s in saved] == [(None, (4, 8))]


def test_custom_functions_save_for_backward_is_recorded():
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return 2 * x * grad

    _, saved = _record(Square.apply, torch.randn(5, requires_grad=True))
    assert [s.nbytes for s in saved] == [5 * 4]


def test_labels_made_without_gradients_are_ignored():
    x = torch.randn(4, requires_grad=True)

    def relabel_under_no_grad(x):
        label(x, ledger.LAYER_INPUT)
        with torch.no_grad():
            label(x, ledger.LN1.input)  # e.g. a checkpoint's no-grad forward of the same input
        return x.sin()

    _, saved = _record(relabel_under_no_grad, x)
    assert [s.name for s in saved] == ["layer/input"]


def test_one_storage_under_two_names_is_a_bug():
    x = torch.randn(4)
    with pytest.raises(ProbeError, match="both mlp/gelu_in and mlp/fc2_in"), SavedTensorRecorder():
        label(x, ledger.GELU_IN)
        label(x, ledger.FC2_IN)


def test_label_outside_a_recorder_does_nothing():
    label(torch.randn(2), ledger.Q)  # no recorder active: no error, no state


def test_recording_leaves_gradients_unchanged():
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    fn = lambda x: torch.softmax(torch.nn.functional.gelu(x) @ x.t(), -1).sum()  # noqa: E731
    (plain,) = torch.autograd.grad(fn(x), x)
    out, _ = _record(fn, x)
    (recorded,) = torch.autograd.grad(out, x)
    assert torch.equal(plain, recorded)
