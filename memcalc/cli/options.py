"""Options shared by the commands that take a model: sizes, knobs, --config.

Flags default to None so that a value left out falls through to the YAML file
(if any) and then to the config's own default; `model_from` does that merge and
leaves all validation to `memcalc.config`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import click

from memcalc.config import ModelConfig, load_config

SIZE_FLAGS = ("b", "s", "h", "a", "t", "L")
KNOB_FLAGS = (
    "mlp", "ffn_hidden_size", "attention", "num_query_groups", "norm", "dropout", "recompute", "dtype",
)
STRATEGY_CHOICES = ("all", "none", "tp", "tp-sp")


def _stack(*decorators: Callable) -> Callable:
    def apply(f: Callable) -> Callable:
        for d in reversed(decorators):
            f = d(f)
        return f
    return apply


config_option = click.option(
    "--config", "config_path", type=click.Path(path_type=Path), default=None,
    help="YAML model config (see configs/); flags override its fields.",
)

size_options = _stack(
    click.option("--b", "b", type=int, help="Micro-batch size [default: 1]."),
    click.option("--s", "s", type=int, help="Sequence length."),
    click.option("--h", "h", type=int, help="Hidden size."),
    click.option("--a", "a", type=int, help="Attention heads."),
    click.option("--t", "t", type=int, help="Tensor-parallel size [default: 1]."),
    click.option("--L", "L", type=int, help="Number of layers [default: 1]."),
)

knob_options = _stack(
    click.option("--mlp", type=click.Choice(["gelu", "swiglu"]), help="MLP activation [default: gelu]."),
    click.option("--ffn-hidden-size", type=int, help="MLP hidden size [default: 4h]."),
    click.option("--attention", type=click.Choice(["eager", "flash"]), help="Core attention [default: eager]."),
    click.option("--num-query-groups", type=int, help="K/V groups for grouped-query attention [default: a]."),
    click.option("--norm", type=click.Choice(["layernorm", "rmsnorm"]), help="Norm [default: layernorm]."),
    click.option("--dropout", type=float, help="Dropout probability; 0 keeps no masks [default: 0.1]."),
    click.option(
        "--recompute", type=click.Choice(["none", "selective", "full"]),
        help="Activation recomputation [default: none].",
    ),
    click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), help="Activation dtype [default: bf16]."),
)

accounting_options = _stack(
    click.option("--exact", is_flag=True, help="Also count the small terms the paper leaves out (norm statistics, LSE)."),
    click.option(
        "--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
        help="Where the layer runs; decides the width of norm statistics under --exact.",
    ),
)

strategy_option = click.option(
    "--strategy", type=click.Choice(STRATEGY_CHOICES), default="all", show_default=True,
    help="Which strategy to show.",
)

model_options = _stack(config_option, size_options, knob_options)


def model_from(params: dict[str, Any]) -> ModelConfig:
    """The validated config that --config and the size/knob flags describe."""
    overrides = {k: params.get(k) for k in SIZE_FLAGS + KNOB_FLAGS}
    return load_config(params.get("config_path"), overrides)


def strategy_names(choice: str) -> list[str]:
    """The strategies a --strategy choice stands for."""
    return ["none", "tp", "tp-sp"] if choice == "all" else [choice]
