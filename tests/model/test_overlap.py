"""Overlapping TP communication with GEMMs: what each method hides, by the timing model, and the buffers it needs."""

import pytest
from click.testing import CliRunner

from memcalc.cli import cli
from memcalc.config.schema import build_config
from memcalc.errors import ConfigError
from memcalc.config.gpus import GPUS
from memcalc.model.overlap import DEFAULT, Pairing, buffer_bytes, chosen, exposed, pairings, resolve
from memcalc.model.strategy import TP, TP_SP

GPT = build_config(dict(b=1, s=2048, h=12288, a=96, t=8, L=96))


def _pair(comm_s, gemm_s):
    return Pairing("x", "y", ("ring-ag",), comm_s, gemm_s, 0)


def test_without_overlap_all_communication_is_exposed():
    assert exposed(_pair(3.0, 10.0), None, t=8) == 3.0


def test_a_ring_hides_communication_when_each_gemm_chunk_outlasts_its_exchange():
    assert exposed(_pair(7.0, 8.0), "ring-ag", t=8) == 0.0  # c/(t-1) = 1 <= g/t = 1
    assert exposed(_pair(14.0, 8.0), "ring-ag", t=8) == pytest.approx(7 * 2 + 1 - 8)  # (t-1) c/(t-1) + g/t - g


def test_a_pipelined_reduce_scatter_leaves_the_last_chunk_exposed_at_least():
    assert exposed(_pair(4.0, 8.0), "pipelined-rs", t=8, splits=4) == pytest.approx(1.0)  # the last chunk's RS
    assert exposed(_pair(4.0, 8.0), "pipelined-rs", t=8, splits=1) == pytest.approx(4.0)  # one chunk hides nothing


def test_bulk_overlap_hides_up_to_the_whole_gemm():
    assert exposed(_pair(3.0, 10.0), "bulk-dgrad", t=8) == 0.0
    assert exposed(_pair(12.0, 10.0), "bulk-dgrad", t=8) == pytest.approx(2.0)


def test_the_default_set_overlaps_every_collective_of_a_layer():
    rows = pairings(GPT, TP_SP, GPUS["h100-80gb"])
    assert len(rows) == 10 and all(chosen(p.methods, frozenset(DEFAULT)) for p in rows)


def test_rs_dgrad_replaces_the_bulk_wgrad_overlap():
    assert chosen(("bulk-wgrad", "rs-dgrad"), resolve(["default", "rs-dgrad"])) == "rs-dgrad"


def test_userbuffers_hold_the_global_input_per_gemm_and_a_ring_reduce_scatter_keeps_2t_minus_1_chunks():
    whole = 1 * 2048 * 12288 * 2
    default = buffer_bytes(GPT, resolve(["default"]), 8)
    assert len(default) == 10 and set(default.values()) == {whole}
    ring = buffer_bytes(GPT, resolve(["ring-rs"]), 8)
    assert ring == {"proj_fprop": whole * 15 // 8, "fc2_fprop": whole * 15 // 8}


def test_overlap_needs_sequence_parallelism_and_megatron():
    with pytest.raises(ConfigError, match="sequence parallelism"):
        pairings(GPT, TP, GPUS["h100-80gb"])
    with pytest.raises(ConfigError, match="unknown overlap method 'ring'"):
        resolve(["ring"])


def test_comm_overlap_prints_the_exposed_time_and_the_buffers_torch_cannot_see():
    out = CliRunner().invoke(cli, ["comm", "--config", "gpt3-175b", "--overlap", "default"],
                             terminal_width=120).output
    assert "qkv_fprop" in out and "outside PyTorch's" in out
