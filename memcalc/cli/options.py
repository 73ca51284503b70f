"""Options shared by the commands that take a model: sizes, knobs, --config or --hf-config. Flags default to
None, so a value left out falls through to the file and then to the config's default (`model_from`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import click

from memcalc.cli import note
from memcalc.config.gpus import DEFAULT_GPU, DEFAULT_RESERVE, GPUS
from memcalc.config.schema import SIZES, ModelConfig, build_knobs, field_default, load_config, load_yaml
from memcalc.cli.types import INTEGER, Integer, Parsed, Real
from memcalc.errors import ConfigError
from memcalc.model.evaluate import check_strategy
from memcalc.model.impls import left_out, strategies_of
from memcalc.model.strategy import STRATEGIES
from memcalc.model.knobs import KNOBS, Knob, Knobs, is_moe
from memcalc.units import human_bytes, parse_bytes

SIZE_FLAGS = SIZES
EXPERT_FLAGS = ("ep", "etp")  # beside --t: how the experts are split
KNOB_FLAGS = tuple(k.name for k in KNOBS)
SHARDING_FLAGS = ("dp_shard", "dp_replicate", "reshard_after_forward", "reduce_dtype", "zero_stage")
LAYOUT_FLAGS = (
    "pp", "vpp", "dp", "cp", "distributed_optimizer", *SHARDING_FLAGS, "vocab_size", "tie_embeddings",
    "add_bias_linear", "gpus", "num_microbatches", "global_batch_size", "make_vocab_size_divisible_by",
)
STRATEGY_CHOICES = ("all", *STRATEGIES)


def _stack(*decorators: Callable) -> Callable:
    def apply(f: Callable) -> Callable:
        for d in reversed(decorators):
            f = d(f)
        return f
    return apply


config_option = click.option(
    "--config", "config_path", type=click.Path(path_type=Path), default=None,
    help="A YAML model config: a path, or the name of a shipped one (see `memcalc configs`); flags override it.",
)

hf_config_option = click.option(
    "--hf-config", "hf_config_path", type=click.Path(path_type=Path), default=None,
    help="A Hugging Face config.json, or a model directory holding one (of a family `memcalc hf-families` lists),"
    " instead of --config.",
)

def _int(flag: str, help: str, name: str | None = None) -> Callable:
    """A flag taking a whole number, None when not given (so a config's value stands)."""
    return click.option(flag, *([name] if name else []), type=INTEGER, help=help)


size_options = _stack(
    _int("--b", "Micro-batch size [default: 1]."),
    _int("--s", "Sequence length."),
    _int("--h", "Hidden size."),
    _int("--a", "Attention heads."),
    _int("--t", "Tensor-parallel size [default: 1]."),
    _int("--ep", "Expert-parallel size: each rank holds num_experts/ep experts [default: 1]."),  # EXPERT_FLAGS
    _int("--etp", "Expert tensor-parallel size (memcalc models etp = t) [default: t]."),
    _int("--L", "Number of layers [default: 1].", name="L"),
)

def knob_option(knob: Knob) -> Callable:
    """A knob's flag, generated from the knob table: its type, choices, help and default."""
    shown = "" if knob.default is None else f" [default: {knob.default}]"  # a size knob's help says what unset means
    help = f"{knob.help[:1].upper()}{knob.help[1:]}{shown}."
    if knob.kind == "flag":
        return click.option(f"{knob.flag}/--no-{knob.flag[2:]}", knob.name, default=None, help=help)
    kinds = {"name": click.STRING, "size": INTEGER, "count": INTEGER, "probability": Real(), "factor": Real()}
    kind = click.Choice(knob.values) if knob.kind == "choice" else kinds[knob.kind]
    return click.option(knob.flag, knob.name, type=kind, help=help)


knob_options = _stack(*(knob_option(k) for k in KNOBS))

accounting_options = _stack(
    click.option(
        "--exact", is_flag=True, help="Also count the small terms the paper leaves out (norm statistics, LSE).",
    ),
    click.option(
        "--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
        help="Whose kernels keep the tensors under --exact: norm statistics' width, CPU composites, attention"
        " kernels (docs/limitations.md); dropout masks are CUDA's 1-byte masks on every device.",
    ),
)

strategy_option = click.option(
    "--strategy", type=click.Choice(STRATEGY_CHOICES), default="all", show_default=True,
    help="Which strategy to show; all: every layout the implementation runs for the knobs (one it does not is named"
    " on stderr).",
)

sharding_options = _stack(  # SHARDING_FLAGS: data-parallel sharding as torchtitan and transformers' Trainer run it
    _int("--dp-shard", "FSDP2 (fully_shard) over this many data-parallel ranks; dp = dp_replicate*dp_shard [default:"
         " no FSDP]."),
    _int("--dp-replicate", "HSDP: FSDP2 groups that replicate each other [default: dp/dp_shard]."),
    click.option("--reshard-after-forward/--no-reshard-after-forward", default=None,
                 help="FSDP2 frees each block's gathered parameters after forward (under torchtitan's pipeline"
                      " never) [default: on]."),
    click.option("--reduce-dtype", type=click.Choice(["fp32", "bf16"]), default=None,
                 help="FSDP2's reduce_dtype, the gradients' dtype in the reduce-scatter [default: fp32]."),
    click.option("--zero-stage", type=Integer(0, 3), default=None,
                 help="DeepSpeed ZeRO stage under transformers' Trainer (--impl hf) [default: none]."),
)

layout_options = _stack(
    _int("--pp", "Pipeline stages [default: 1]."),
    _int("--vpp", "Model chunks per stage, interleaved 1F1B [default: plain 1F1B]."),
    _int("--dp", "Data-parallel size; shards optimizer states with --distributed-optimizer."),
    _int("--cp", "Context-parallel size: each rank keeps s/cp tokens [default: 1]."),
    click.option(
        "--distributed-optimizer/--no-distributed-optimizer", default=None,
        help="Shard fp32 master weights and Adam moments over dp*cp [default: off].",
    ),
    sharding_options,
    _int("--vocab-size", "Vocabulary size v [default: 51200]."),
    click.option(
        "--tie-embeddings/--untie-embeddings", default=None, help="Output layer shares the embedding [default: tied]."
    ),
    click.option(
        "--bias-linear/--no-bias-linear", "add_bias_linear", default=None,
        help="Biases on every linear (add_bias_linear; Megatron-LM's --disable-bias-linear is --no-bias-linear)"
        " [default: on, as the seed's; the libraries' Llamas: off].",
    ),
    _int("--gpus", "GPUs in the job: dp is derived as gpus/(t*pp*cp), which must be whole."),
    _int("--num-microbatches", "Micro-batches per step; fewer than pp caps what a stage keeps in flight [default:"
         " enough to fill it]."),
    _int("--global-batch-size", "Sequences per step: micro-batches = it/(dp*b)."),
    _int("--make-vocab-size-divisible-by",
         "Pad v up to a multiple of this times t, as Megatron-LM does [default: 128]."),
)


model_options = _stack(config_option, hf_config_option, size_options, knob_options)
# estimate, fit and comm: a model in its whole parallel layout, and the strategies to show
layout_model_options = _stack(model_options, layout_options, strategy_option)


BYTES = Parsed("size", parse_bytes)  # a size such as 80GiB, 40GB or 1024MiB (`memcalc.units.parse_bytes`)


def _device_options(gpu_default: str) -> Callable:
    """--gpu, --device-memory and --reserve; `gpu_default` closes --gpu's help (estimate assumes an H100, fit
    assumes nothing: it asks for --gpu or --budget)."""
    return _stack(
        click.option(
            "--gpu", type=click.Choice(list(GPUS)), default=None,
            help=f"The GPU, for its usable memory as its driver reports it [{gpu_default}].",
        ),
        click.option(
            "--device-memory", type=BYTES, default=None,
            help="Memory of one GPU, instead of --gpu's (e.g. 80GiB).",
        ),
        click.option(
            "--reserve", type=BYTES, default=None,
            help="What PyTorch's allocator does not see (CUDA context, NCCL buffers, fragmentation), taken off the"
            f" device memory [default: {human_bytes(DEFAULT_RESERVE)}].",
        ),
    )


device_options = _device_options(f"default: {DEFAULT_GPU}")
fit_device_options = _device_options("no default: give --gpu or --budget")


def model_from(params: dict[str, Any]) -> ModelConfig:
    """The validated config that --config or --hf-config and the flags describe (the fields --hf-config used
    go to stderr, so stdout stays clean for --json)."""
    fields, path, read = file_fields(params)
    overrides = {k: params.get(k) for k in SIZE_FLAGS + EXPERT_FLAGS + KNOB_FLAGS + LAYOUT_FLAGS}
    config = load_config(path, overrides, base=fields)
    if read is not None:
        note(f"memcalc: {read}{_defaulted_knobs(config, fields, overrides)}")
    elif path is not None and overrides.get("impl") not in (None, fields.get("impl")) and (
            switched := _switched_knobs(config, fields, overrides)):
        note(f"memcalc: note: {config.name or path.stem} sets no {', '.join(k.split('=')[0] for k in switched)}: impl"
             f" {config.impl}'s defaults apply ({', '.join(switched)}), not the seed's")
    return config


def _unset_knobs(config: ModelConfig, fields: dict[str, Any], overrides: dict[str, Any]) -> list[Knob]:
    """The knobs neither the file nor a flag set, so a default stands (a dense model's MoE knobs change nothing:
    never named)."""
    return [k for k in KNOBS if k.name not in fields and overrides.get(k.name) is None
            and (config.moe or not is_moe(k))]


def _defaulted_knobs(config: ModelConfig, fields: dict[str, Any], overrides: dict[str, Any]) -> str:
    """The knobs config.json cannot say (the attention kernel, ...) and no flag set: the implementation's
    defaults, or the seed's, named so that every assumed value is on the line."""
    taken = [
        f"{k.name}={getattr(config, k.name)}" for k in _unset_knobs(config, fields, overrides)
        if getattr(config, k.name) is not None
        and (not k.impls or config.impl in k.impls)  # another library's setting: this one has none
    ]
    return f"; defaults (impl {config.impl}'s, else the seed's): {', '.join(taken)}" if taken else ""


def _switched_knobs(config: ModelConfig, fields: dict[str, Any], overrides: dict[str, Any]) -> list[str]:
    """The knobs a --config file leaves unset that --impl gives another value than the seed's (GPT-3 under --impl hf
    is a SwiGLU layer with RMSNorm and no dropout unless the file says otherwise)."""
    return [f"{k.name}={getattr(config, k.name)}" for k in _unset_knobs(config, fields, overrides)
            if getattr(config, k.name) != field_default(k.name)]


def knobs_from(params: dict[str, Any]) -> Knobs:
    """For the commands that need no sizes (formula, explain): the knobs of --config or --hf-config (whose sizes are
    then validated too) with the knob flags laid over, else of the flags alone."""
    if params.get("config_path") is not None or params.get("hf_config_path") is not None:
        return Knobs.of(model_from(params))
    return Knobs.of(build_knobs({k: params[k] for k in KNOB_FLAGS if params.get(k) is not None}))


def file_fields(params: dict[str, Any]) -> tuple[dict[str, Any], Path | None, str | None]:
    """The fields --config or --hf-config holds, that file, and (for --hf-config) which fields it used."""
    path, hf_path = params.get("config_path"), params.get("hf_config_path")
    if hf_path is None:
        return (load_yaml(path) if path is not None else {}), path, None
    if path is not None:
        raise ConfigError("give --config or --hf-config, not both")
    from memcalc.config.hf import read_hf_config

    hf = read_hf_config(hf_path)
    return dict(hf.fields), hf_path, hf.describe()


def strategy_names(choice: str, knobs: Any) -> list[str]:
    """The strategies a --strategy choice stands for: "all" is every layout the implementation runs for these
    knobs, and a layout it leaves out for them is named, with why, in one line on stderr. A layout named alone
    is left for `plan` to refuse (one line, exit 2)."""
    if choice != "all":
        return [choice]
    note_left_out(knobs)
    return list(strategies_of(knobs))


def strategies_at(choice: str, config: ModelConfig) -> list[str]:
    """strategy_names for a config at its sizes: under "all", a layout these sizes rule out (sequence parallelism
    where t does not divide s) is also left out (`runnable`). A layout named alone is refused (one line, exit 2)."""
    names = strategy_names(choice, config)
    return runnable(names, lambda n: check_strategy(config, STRATEGIES[n])) if choice == "all" else names


def runnable(names: list[str], check: Callable[[str], Any]) -> list[str]:
    """The layouts `check` (a layout's name -> ConfigError, or nothing) lets through; each it refuses is named on
    stderr, with why, and left out. Where it refuses every layout that splits by t, the first one's error is raised
    instead: no layout shown would read t."""
    refused = {}
    for name in names:
        try:
            check(name)
        except ConfigError as error:
            refused[name] = error
    split = [n for n in names if n != "none"]
    if split and all(n in refused for n in split):
        raise refused[split[0]]
    for name, why in refused.items():
        note(f"memcalc: note: {name} left out: {why}")
    return [n for n in names if n not in refused]


def note_left_out(knobs: Any) -> None:
    """Name on stderr, one line each, the layouts the implementation does not run for these knobs, and why."""
    for line in left_out(knobs):
        note(f"memcalc: note: {line}")
