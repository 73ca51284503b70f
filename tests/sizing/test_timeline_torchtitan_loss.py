"""torchtitan's loss in the step walk (memcalc.sizing.timeline.torchtitan): ChunkedLossWrapper, its model configs'
loss (loss_chunks, 8 unless set), and its plain CrossEntropyLoss (loss_chunks 0); measured against MemTracker in
tests/probe/libs/test_torchtitan*_step.py, test_torchtitan_fsdp.py and test_torchtitan_pp.py."""

import pytest

from memcalc.config.schema import build_config
from memcalc.errors import ConfigError
from memcalc.model.knobs import Accounting
from memcalc.model.strategy import STRATEGIES
from memcalc.sizing.timeline import timeline

from tests.helpers import TORCHTITAN_LLAMA3, make_config

CPU = Accounting(exact=True, device="cpu")


def _peak(**changes):
    return timeline(make_config(TORCHTITAN_LLAMA3, **changes), STRATEGIES["none"], CPU).peak


def test_unset_the_loss_runs_in_torchtitans_eight_chunks():
    unset = {k: v for k, v in TORCHTITAN_LLAMA3.items() if k != "loss_chunks"}
    walk = timeline(make_config(unset), STRATEGIES["none"], CPU)
    assert walk.moments == timeline(make_config(unset, loss_chunks=8), STRATEGIES["none"], CPU).moments
    assert walk.moments != timeline(make_config(unset, loss_chunks=0), STRATEGIES["none"], CPU).moments


def test_each_chunk_makes_logits_of_its_own_tokens_only():
    """A large vocabulary puts the peak in the loss: a chunk's (b, s/n, v) logits and fp32 copies, not the whole
    sequence's, so the peak falls by the whole logits' fp32 bytes less a chunk's."""
    sizes = {"vocab_size": 4000, "s": 32, "b": 2}
    plain, chunked = _peak(loss_chunks=0, **sizes), _peak(loss_chunks=4, **sizes)
    logits = 2 * 32 * 4000  # b*s*v
    assert max(x.bytes for x in chunked.live if x.name.startswith("lm_head/logits")) == 2 * logits // 4
    assert not any(x.name == "lm_head/logits" for x in chunked.live)
    assert plain.bytes - chunked.bytes > 4 * logits // 2


def test_the_gradient_buffer_is_fp32_hidden_states_whole():
    """GradAccumulator's buffer: the (b, s, h) fp32 gradient, live through every chunk."""
    walk = timeline(make_config(TORCHTITAN_LLAMA3, loss_chunks=4), STRATEGIES["none"], CPU)
    buffers = {x.bytes for m in walk.moments for x in m.live if x.name == "loss/gradient buffer"}
    assert buffers == {4 * 2 * 24 * 64}


@pytest.mark.parametrize("s, chunks", [(9, 4), (24, 5), (7, 8)])
def test_a_sequence_the_chunks_do_not_divide_is_refused_with_its_numbers(s, chunks):
    """torchtitan refuses it at its loss (torch._check): the step walk, not the layer, which takes any s."""
    config = make_config(TORCHTITAN_LLAMA3, s=s, loss_chunks=chunks)
    with pytest.raises(ConfigError, match=rf"s={s} is not divisible by loss_chunks={chunks} .*use loss_chunks 0"):
        timeline(config, STRATEGIES["none"], CPU)


def test_unset_the_default_eight_chunks_refuse_a_sequence_they_do_not_divide():
    config = build_config({k: v for k, v in TORCHTITAN_LLAMA3.items() if k != "loss_chunks"} | {"s": 12})
    with pytest.raises(ConfigError, match="s=12 is not divisible by loss_chunks=8"):
        timeline(config, STRATEGIES["none"], CPU)


def test_loss_chunks_is_torchtitans_setting_only():
    with pytest.raises(ConfigError, match="loss_chunks=4 is a setting of impl torchtitan only; impl megatron has none"
                                          r" \(leave it unset\)"):
        build_config({"s": 8, "h": 64, "a": 8, "loss_chunks": 4})


def test_with_pp_and_dp_shard_the_chunked_loss_is_refused_by_name():
    config = make_config(TORCHTITAN_LLAMA3, pp=2, dp_shard=2, loss_chunks=4, L=2)
    with pytest.raises(ConfigError, match=r"chunked loss \(loss_chunks=4\) with pp and dp_shard"):
        timeline(config, STRATEGIES["none"], CPU, stage="last")
