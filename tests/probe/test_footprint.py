"""`measure` counts the least it will allocate before any rank starts, and refuses a run the machine cannot hold."""

import pytest

from memcalc.config.schema import build_config
from memcalc.errors import ConfigError
from memcalc.model.evaluate import estimate
from memcalc.model.knobs import Accounting
from memcalc.model.strategy import STRATEGIES
from memcalc.probe import footprint as fp

TINY = build_config({"s": 16, "h": 64, "a": 8, "t": 2, "b": 2, "dtype": "bf16"})


def test_a_rank_needs_at_least_its_saved_activations_and_its_weights_twice():
    activations = estimate(TINY, STRATEGIES["tp"], Accounting(exact=True, device="cpu")).per_layer_bytes
    # qkv 64x192+192, proj 64x64+64, fc1 64x256+256, fc2 256x64+64 split by t=2 (row biases whole), two layernorms.
    weights = ((64 * 192 + 192) // 2 + (64 * 64 // 2 + 64) + (64 * 256 + 256) // 2 + (256 * 64 // 2 + 64) + 4 * 64)
    assert fp.footprint(TINY, "tp", "cpu", ranks_here=2) == fp.Footprint("tp", activations + 2 * 2 * weights, 2)


def test_no_parallelism_runs_as_one_rank_whatever_the_launch():
    assert fp.footprint(TINY, "none", "cpu", ranks_here=2).ranks_here == 1


def test_a_run_that_fits_passes(monkeypatch):
    monkeypatch.setattr(fp, "available", lambda device: (10**12, "memory"))
    fp.check_fits(TINY, ["none", "tp", "tp-sp"], "cpu", ranks_here=2)


def test_a_run_that_does_not_fit_is_one_line_naming_the_bytes(monkeypatch):
    need = fp.footprint(TINY, "tp", "cpu", ranks_here=2).bytes
    monkeypatch.setattr(fp, "available", lambda device: (need - 1, "this machine's available memory"))
    with pytest.raises(ConfigError, match=f"measure tp would allocate at least {need:,} bytes .* x 2 ranks") as caught:
        fp.check_fits(TINY, ["tp", "tp-sp"], "cpu", ranks_here=2)
    assert f"but this machine's available memory is {need - 1:,} bytes" in str(caught.value)


def test_on_gpus_one_rank_is_held_against_one_gpu(monkeypatch):
    per_rank = fp.footprint(TINY, "tp", "cuda", ranks_here=2).per_rank
    monkeypatch.setattr(fp, "available", lambda device: (per_rank, "one GPU's memory"))
    fp.check_fits(TINY, ["tp"], "cuda", ranks_here=2)  # 2 ranks, but a GPU each


def test_unknown_memory_refuses_nothing(monkeypatch):
    monkeypatch.setattr(fp, "available", lambda device: (None, "unknown"))
    fp.check_fits(build_config({"s": 2**40, "h": 2**20, "a": 8}), ["none"], "cpu", ranks_here=1)


def test_this_machines_memory_is_read():
    have, what = fp.available("cpu")
    assert have is None or have > 0 and what


def test_the_meta_device_allocates_nothing_so_any_size_passes(monkeypatch):
    monkeypatch.setattr(fp, "available", lambda device: (1, "memory"))
    fp.check_fits(build_config({"s": 2**40, "h": 2**20, "a": 8}), ["none", "tp"], "meta", ranks_here=2)
