"""Sizing a cluster, not one GPU: dp derived from --gpus, micro-batches per step capping what a
pipeline stage keeps, GPU presets less a reserve, and fit at a fixed GPU count."""

import pytest

from memcalc.config.gpus import DEFAULT_RESERVE, GPUS, budget_for
from memcalc.config.schema import build_config, load_yaml
from memcalc.errors import ConfigError
from memcalc.model.strategy import TP_SP
from memcalc.sizing.fit import fit
from memcalc.sizing.pipeline import stages
from memcalc.sizing.totals import per_gpu

LLAMA = load_yaml("llama3-70b")  # t=8, L=80
SMALL = dict(s=64, h=32, a=4, L=8, t=2)


def test_gpus_derive_dp_as_what_t_pp_and_cp_leave():
    assert build_config(LLAMA | {"gpus": 64, "pp": 4}).dp == 2
    assert build_config(LLAMA | {"gpus": 64, "pp": 2, "cp": 2, "attention": "flash"}).dp == 2


def test_gpus_that_t_pp_cp_do_not_divide_name_the_equation_and_the_gpus_left_over():
    with pytest.raises(ConfigError) as err:
        build_config(LLAMA | {"gpus": 60, "pp": 4})
    assert str(err.value) == (
        "gpus=60 is not divisible by t*pp*cp=8*4*1=32 (dp = gpus/(t*pp*cp) must be whole; 28 GPUs left over)"
    )


def test_a_dp_given_with_gpus_must_agree_and_one_that_does_is_kept():
    with pytest.raises(ConfigError, match=r"t\*pp\*cp\*dp=8\*4\*1\*4=128 is not gpus=64 \(leave dp out"):
        build_config(LLAMA | {"gpus": 64, "pp": 4, "dp": 4})
    assert build_config(LLAMA | {"gpus": 64, "pp": 4, "dp": 2}).dp == 2


def test_global_batch_size_gives_micro_batches_per_data_parallel_rank():
    config = build_config(SMALL | {"dp": 2, "b": 2, "global_batch_size": 32})
    assert config.microbatches == 8
    assert build_config(SMALL).microbatches is None  # unknown: the schedule's steady state is assumed


@pytest.mark.parametrize("fields,needle", [
    ({"dp": 2, "b": 3, "global_batch_size": 32}, "global_batch_size=32 is not divisible by dp*b=2*3=6"),
    ({"dp": 2, "global_batch_size": 32, "num_microbatches": 4}, "num_microbatches=4 is not global_batch_size/(dp*b)"),
    ({"pp": 4, "vpp": 2, "num_microbatches": 6}, "num_microbatches=6 is not divisible by pp=4"),
])
def test_micro_batch_rules_are_one_line_naming_the_values(fields, needle):
    with pytest.raises(ConfigError) as err:
        build_config(SMALL | {"t": 1} | fields)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("m,kept", [(1, 1), (2, 2), (3, 3), (4, 4), (5, 4), (64, 4)])
def test_1f1b_first_stage_keeps_at_most_the_steps_micro_batches(m, kept):
    first, last = stages(8, 4, None, m)
    assert (first.layer_slots, first.embedding_in_flight) == (2 * kept, kept)
    assert (last.layer_slots, last.output_in_flight) == (2, 1)


def test_interleaved_step_of_pp_micro_batches_runs_every_forward_before_any_backward_on_the_first_stage_only():
    """megatron-core's get_pp_rank_microbatches: rank 0's warm-up covers all m*vpp chunks (m of them the
    embedding's); the last rank's (vpp-1)*pp do not, so it keeps the steady state's."""
    first, last = stages(16, 4, 2, 4)
    assert (first.layer_slots, first.embedding_in_flight) == (2 * 8, 4)
    assert stages(16, 4, 2, 4)[1] == stages(16, 4, 2, None)[1]
    assert stages(16, 4, 2, 8) == stages(16, 4, 2, None)  # 2p micro-batches already reach the steady state


def test_a_short_step_lowers_the_first_stages_activations_and_nothing_else():
    fields = SMALL | {"pp": 4, "t": 1}
    steady, short = (per_gpu(build_config(fields | x), TP_SP) for x in ({}, {"num_microbatches": 2}))
    layers = {st.stage.name: st.terms[0].bytes for st in steady.stages}
    assert {st.stage.name: st.terms[0].bytes for st in short.stages} == {"first": layers["first"] // 2,
                                                                         "last": layers["last"]}
    assert short.stages[0].bytes("model states") == steady.stages[0].bytes("model states")


def test_presets_are_the_drivers_usable_bytes_not_the_marketing_capacity():
    assert GPUS["h100-80gb"].memory_bytes == 81559 * 2**20 < 80 * 2**30
    assert GPUS["mi300x"].memory_bytes == 205822885888
    assert {"h100-80gb", "h200", "a100-40gb", "a100-80gb", "b200", "mi300x"} == set(GPUS)


def test_the_budget_is_the_device_less_the_reserve_and_device_memory_overrides_the_preset():
    assert budget_for("h200", None, None).bytes == GPUS["h200"].memory_bytes - DEFAULT_RESERVE
    assert budget_for("h200", 40 * 2**30, 0).bytes == 40 * 2**30
    with pytest.raises(ConfigError, match="reserve=.* must be less than the device memory"):
        budget_for(None, 2**30, 2**30)


def test_fit_at_a_fixed_gpu_count_derives_dp_for_each_t_it_tries():
    config = build_config(LLAMA | {"gpus": 64, "pp": 4, "distributed_optimizer": True})
    answer = fit(config, TP_SP, "t", budget_for("h100-80gb", None, None).bytes, count="total").answer
    fields = LLAMA | {"gpus": 64, "pp": 4, "distributed_optimizer": True, "t": answer.value}
    assert answer.bytes == per_gpu(build_config(fields), TP_SP).bytes()
    assert build_config(fields).dp == 64 // (answer.value * 4)


def test_fit_solves_the_smallest_pp_that_fits_and_skips_those_the_gpus_cannot_hold():
    h100 = budget_for("h100-80gb", None, None).bytes
    config = build_config(LLAMA | {"gpus": 64, "recompute": "selective"})
    found = fit(config, TP_SP, "pp", h100)
    assert (found.answer.value, found.beyond.value) == (4, 2)
    assert found.beyond.bytes > h100 >= found.answer.bytes
    on_48 = fit(build_config(LLAMA | {"gpus": 48, "recompute": "selective"}), TP_SP, "pp", h100)
    assert on_48.answer is None and on_48.beyond.value == 2  # pp=4 and 5 leave 48/(8*pp) GPUs unwhole: invalid


def test_fit_solves_the_smallest_cp_that_fits_a_long_sequence_at_a_fixed_gpu_count():
    fields = LLAMA | {"gpus": 128, "pp": 4, "s": 32768, "distributed_optimizer": True, "recompute": "selective"}
    h100 = budget_for("h100-80gb", None, None).bytes
    found = fit(build_config(fields), TP_SP, "cp", h100)
    assert (found.answer.value, found.beyond.value) == (4, 2)
    assert found.answer.bytes == per_gpu(build_config(fields | {"cp": 4}), TP_SP).bytes()
    assert build_config(fields | {"cp": 4}).dp == 1  # 128 = 8*4*4*1
