"""Megatron's uneven pipeline split: `ModelConfig.rank_chunks` places every model chunk's layers where megatron-core's
own get_num_layers_to_build and get_transformer_layer_offset put them, and memcalc refuses what megatron-core
refuses."""

import itertools
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from memcalc.errors import ConfigError  # noqa: E402
from memcalc.probe.libs.megatron_ddp import pipeline_fields  # noqa: E402

from tests.helpers import make_config  # noqa: E402

BASE = dict(impl="megatron", h=64, a=4, s=64, b=1)
# memcalc's own refusals, beyond megatron-core's: a layout it does not size (each names memcalc or pp >= 2)
OWN = ("memcalc", "needs pp >= 2")


def _layouts():
    """Layers, stages, chunks and each split knob over small values, megatron-core's refusals among them."""
    for L, pp, vpp in itertools.product((3, 4, 6, 7, 13), (1, 2, 3, 4), (None, 2)):
        for first, last in itertools.product((None, 1, 2, 4), (None, 1, 2, 3)):
            yield dict(L=L, pp=pp, vpp=vpp, num_layers_in_first_pipeline_stage=first,
                       num_layers_in_last_pipeline_stage=last)
        for embedding, loss in ((True, False), (False, True), (True, True)):
            yield dict(L=L, pp=pp, vpp=vpp, account_for_embedding_in_pipeline_split=embedding,
                       account_for_loss_in_pipeline_split=loss)
    yield dict(L=61, pp=16, vpp=None, num_layers_in_first_pipeline_stage=3, num_layers_in_last_pipeline_stage=2)
    yield dict(L=61, pp=16, vpp=None, num_layers_in_first_pipeline_stage=4, num_layers_in_last_pipeline_stage=1)


def _megatron_chunks(fields: dict, pp: int, vpp: int | None) -> list[list[range]] | None:
    """Each pipeline rank's model chunks as megatron-core places them, from a TransformerConfig of `fields`; None
    where it refuses the layout (its ValueError, an assertion), fails on it (divides by zero) or places fewer than no
    layers in a chunk."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            core = TransformerConfig(hidden_size=64, num_attention_heads=4, pipeline_dtype=torch.bfloat16, **fields)
            found = [[(get_transformer_layer_offset(core, v, r), get_num_layers_to_build(core, v, r))
                      for v in (range(vpp) if vpp else (None,))] for r in range(pp)]
    except (ValueError, AssertionError, ZeroDivisionError):  # the last at pp 2 under vpp with both ends set
        return None
    if any(n < 0 for chunks in found for _, n in chunks):
        return None
    return [[range(start, start + n) for start, n in chunks] for chunks in found]


def test_every_rank_holds_the_layers_megatron_core_places_there_and_memcalc_refuses_what_it_refuses():
    placed = 0
    for layout in _layouts():
        try:
            config = make_config(BASE | layout)
        except ConfigError as error:
            config, why = None, str(error)
        fields = pipeline_fields(config) if config else {
            "num_layers": layout["L"], "pipeline_model_parallel_size": layout["pp"],
            "virtual_pipeline_model_parallel_size": layout["vpp"],
            **{k: v for k, v in layout.items() if k not in ("L", "pp", "vpp")}}
        megatron = _megatron_chunks(fields, layout["pp"], layout["vpp"])
        if config is None:
            assert megatron is None or any(x in why for x in OWN), (layout, why)
            continue
        assert megatron == [config.rank_chunks(r) for r in range(config.pp)], layout
        placed += 1
    assert placed > 100
