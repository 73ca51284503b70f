"""torch stays out of `import memcalc.probe`, and a missing torch reads as one line saying how to install it."""

import subprocess
import sys
from pathlib import Path

import pytest

from memcalc.errors import ProbeError
from memcalc.probe import require_torch

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.procs  # every test here runs a fresh interpreter


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_importing_the_probe_package_does_not_import_torch():
    done = _python("import sys, memcalc.probe; print('torch' in sys.modules)")
    assert done.stdout.strip() == "False", done.stderr


def test_without_torch_require_torch_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # what an uninstalled package looks like to import
    with pytest.raises(ProbeError) as caught:
        require_torch()
    assert "\n" not in str(caught.value)
    assert "pip install torch==2.13.0 (in a checkout: pip install -e '.[probe]')" in str(caught.value)


def test_without_torch_importing_a_probe_module_raises_probe_error():
    done = _python("import sys; sys.modules['torch'] = None; import memcalc.probe.launch")
    assert "memcalc.errors.ProbeError: the probe needs PyTorch" in done.stderr
