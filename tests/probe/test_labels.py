"""Labels name tensors made inside code the probe does not edit: by module and by the function called there."""

import pytest

pytest.importorskip("torch")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from memcalc.model import ledger  # noqa: E402
from memcalc.probe.libs.labels import Labels, Rule  # noqa: E402
from memcalc.probe.recorder import SavedTensorRecorder  # noqa: E402


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _record(rules):
    block = _Block()
    x = torch.randn(2, 3, 4, requires_grad=True)
    with SavedTensorRecorder(block.parameters()) as recorder, Labels(block, rules):
        block(x).sum().backward()
    return {s.name: s for s in recorder.saved}


def test_a_module_input_and_a_function_result_get_their_ledger_names():
    saved = _record([
        Rule("fc1", "forward", ledger.FC1_IN, arg=0),
        Rule("", "gelu", ledger.FC2_IN),
        Rule("fc1", "forward", ledger.GELU_IN),
    ])
    assert set(saved) == {"mlp/fc1_in", "mlp/gelu_in", "mlp/fc2_in"}
    assert saved["mlp/gelu_in"].shape == (2, 3, 8)


def test_a_rule_for_another_module_or_call_names_nothing():
    saved = _record([Rule("fc2", "gelu", ledger.FC2_IN), Rule("", "gelu", ledger.GELU_IN, nth=1)])
    assert set(saved) == {None}
