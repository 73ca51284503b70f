"""The step timeline of transformers' LlamaForCausalLM (`--impl hf`) as a model: each layer adds the hf ledger's
saved tensors less the RoPE tables every layer shares, the model states count transformers' unpadded vocabulary
and RoPE's two fp32 buffers, backward leaves only the batch and the loss behind, and what it does not walk is
refused by name. Against MemTracker: tests/probe/libs/test_hf_step.py."""

import pytest

from memcalc.config.schema import build_config
from memcalc.errors import ConfigError
from memcalc.model.evaluate import estimate
from memcalc.model.impls import hf as rules
from memcalc.model.knobs import Accounting
from memcalc.model.strategy import STRATEGIES
from memcalc.sizing.states import total_params
from memcalc.sizing.timeline import ACTIVATIONS, PARAMETERS, TEMPORARIES, timeline

LLAMA = dict(
    impl="hf", b=2, s=24, h=64, a=8, L=3, vocab_size=250, mlp="swiglu", ffn_hidden_size=176, norm="rmsnorm",
    num_query_groups=2, position_embedding_type="rope", add_bias_linear=False, dropout=0.0, tie_embeddings=False,
)
CPU = Accounting(exact=True, device="cpu")
NONE, TP = STRATEGIES["none"], STRATEGIES["tp"]


def _timeline(strategy=NONE, **changes):
    config = build_config(LLAMA | changes)
    return config, timeline(config, strategy, CPU)


@pytest.mark.parametrize("strategy", [NONE, TP], ids=["none", "tp"])
@pytest.mark.parametrize("attention", ["eager", "flash"])
def test_each_layer_adds_the_hf_ledgers_saved_tensors_less_the_shared_rope_tables(attention, strategy):
    config, steps = _timeline(strategy, attention=attention, t=2)
    ends = [m.by_category()[ACTIVATIONS] for m in steps.moments if m.phase == "forward" and ".layers." in f".{m.where}"]
    ledger = {x.tensor.name: x.bytes for x in estimate(config, strategy, CPU).tensors}
    shared = ledger[rules.ROPE_COS.name] + ledger[rules.ROPE_SIN.name]
    # After the first layer (whose input is LlamaModel's inputs_embeds too, live to the end of forward), each
    # layer's end holds its input, the residual stream after attention, the MLP's output and its own output.
    assert [b - a for a, b in zip(ends[1:], ends[2:])] == [sum(ledger.values()) - shared] * (config.L - 2)


@pytest.mark.parametrize("tied", [False, True])
def test_the_weights_are_transformers_unpadded_vocabulary_and_ropes_two_fp32_buffers(tied):
    config, steps = _timeline(tie_embeddings=tied)
    params = total_params(config)  # as published: one stage, no vocabulary padding
    assert steps.steady.by_category()[PARAMETERS] == 2 * params + 2 * 4 * (config.h // config.a // 2)


def test_backward_leaves_only_the_batch_and_the_loss_behind():
    config, steps = _timeline()
    optimizer = steps.moments[-1]
    left = {x.name for x in optimizer.live if x.category in (ACTIVATIONS, TEMPORARIES)}
    assert left == {"embedding/input_ids", "batch/labels", "loss/value"}
    batch_and_loss = 2 * 8 * config.b * config.s + 4  # int64 token ids and labels, the fp32 loss
    steady = steps.steady.by_category()
    assert optimizer.by_category() == steady | {ACTIVATIONS: steady[ACTIVATIONS] + batch_and_loss}


@pytest.mark.parametrize("changes, named", [
    ({"dropout": 0.1}, "dropout 0.1"),
    ({"recompute": "full"}, "recompute full"),
    ({"add_bias_linear": True}, "biases"),
    ({"norm": "layernorm", "mlp": "gelu", "num_query_groups": None}, "norm layernorm with mlp gelu"),
    ({"position_embedding_type": "learned_absolute"}, "position_embedding_type learned_absolute"),
    ({"dtype": "fp32"}, "dtype fp32"),
])
def test_what_the_hf_walk_does_not_model_is_refused_by_name(changes, named):
    with pytest.raises(ConfigError, match=f"for impl hf does not model {named}"):
        _timeline(**changes)


def test_under_tp_the_loss_sees_every_logit_and_the_embedding_gradient_is_the_whole_table():
    """lm_head's colwise_gather_output gathers the logits, so the loss's fp32 tensors are t = 1's; DTensor gives the
    vocabulary-parallel embedding a Replicate gradient, the whole (v, h) table, before this rank's rows are taken."""
    _, none = _timeline(t=2)
    config, tp = _timeline(TP, t=2)
    loss = "log_softmax's backward: three fp32 (b*s, v) tensors"
    at = [m.by_category()[TEMPORARIES] for steps in (none, tp) for m in steps.moments if m.what == loss]
    assert at == [2 * 4 * config.b * config.s * config.vocab_size] * 2  # the third is kept from forward
    rows = next(m for m in tp.moments if m.what == "this rank's rows of the embedding's gradient")
    live = {x.name: x.bytes for x in rows.live}
    assert live["grad/embedding (.grad)"] == 2 * live["grad/embedding (rows)"] == 2 * config.vocab_size * config.h


@pytest.mark.parametrize("changes, named", [
    ({"t": 2, "tie_embeddings": True}, "tied embeddings under tp"),
    ({"t": 4, "num_query_groups": 4}, "vocab_size=250 that t=4 does not divide"),
])
def test_what_the_hf_walk_does_not_model_under_tp_is_refused_by_name(changes, named):
    with pytest.raises(ConfigError, match=f"for impl hf does not model {named}"):
        _timeline(TP, **changes)


def test_hf_refuses_tp_sp_citing_transformers():
    with pytest.raises(ConfigError, match="does not run tp-sp .*transformers has no sequence parallelism"):
        _timeline(STRATEGIES["tp-sp"], t=2)
