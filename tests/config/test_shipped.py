"""Every shipped config loads and estimates; the GPT ones are the seed's model; each is found by
name from any directory."""

from fractions import Fraction
from pathlib import Path

import pytest

from memcalc.config.schema import load_config, load_yaml
from memcalc.config.shipped import shipped_dir, shipped_names
from memcalc.errors import ConfigError
from memcalc.model.evaluate import estimate
from memcalc.model.impls import strategies_of
from memcalc.model.strategy import STRATEGIES

CONFIGS = sorted((Path(__file__).parents[2] / "memcalc" / "configs").glob("*.yaml"))
GPT = [p for p in CONFIGS if p.stem.startswith("gpt3-")]


def test_the_shipped_configs_are_found():
    assert len(CONFIGS) >= 7 and len(GPT) >= 4


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_loads_and_every_strategy_its_implementation_runs_estimates(path):
    config = load_config(path, {})
    assert config.name == path.stem
    runs = strategies_of(config)
    assert "none" in runs and "tp-sp" in runs
    for strategy in STRATEGIES.values():
        if strategy.name not in runs:  # e.g. megatron's MoE layer under tp: refused in one line, with why
            with pytest.raises(ConfigError, match=f"does not run {strategy.name} .*; it runs: {', '.join(runs)}$"):
                estimate(config, strategy)
            continue
        result = estimate(config, strategy)
        moe_layers = config.L - result.dense_layers  # every layer, or DeepSeek-V3's 58 past its first 3 dense ones
        assert result.total_bytes == moe_layers * result.per_layer_bytes + result.dense_layers * result.dense_layer_bytes > 0


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_megatron_runs_tp_for_exactly_the_configs_without_experts(path):
    config = load_config(path, {})
    assert ("tp" in strategies_of(config)) == (config.impl != "megatron" or not config.moe)


@pytest.mark.parametrize("path", GPT, ids=lambda p: p.stem)
def test_gpt_configs_keep_every_knob_at_the_seeds_default(path):
    knobs = {"mlp", "ffn_hidden_size", "attention", "num_query_groups", "norm", "dropout", "recompute", "dtype"}
    assert not knobs & set(load_yaml(path))


@pytest.mark.parametrize("path", GPT, ids=lambda p: p.stem)
def test_gpt_configs_estimate_the_seeds_formulas(path):
    c = load_config(path, {})
    sbh, core = c.s * c.b * c.h, Fraction(5 * c.a * c.s, c.h)
    seed = {"none": 34 + core, "tp": 10 + Fraction(24, c.t) + core / c.t, "tp-sp": Fraction(34, c.t) + core / c.t}
    for name, per_sbh in seed.items():
        assert estimate(c, STRATEGIES[name]).per_layer_bytes == sbh * per_sbh, name


def test_the_configs_ship_inside_the_package():
    assert shipped_dir() == CONFIGS[0].parent and shipped_names() == [p.stem for p in CONFIGS]


@pytest.mark.parametrize("given", ["gpt3-175b", "gpt3-175b.yaml"])
def test_a_shipped_config_is_found_by_name_from_any_directory(tmp_path, monkeypatch, given):
    monkeypatch.chdir(tmp_path)
    assert load_config(Path(given), {}).name == "gpt3-175b"


def test_a_file_beside_the_user_wins_over_a_shipped_config_of_the_same_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text("name: mine\ns: 16\nh: 64\na: 8\n")
    assert load_config(Path("tiny.yaml"), {}).name == "mine"
