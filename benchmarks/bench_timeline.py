"""How long the step timeline (`estimate --totals`' peak) takes to walk, in this process.

Issue 19's bar: deriving every layer from one op description must not slow the calculator; a full-model
timeline (every layer of DeepSeek-V3 671B, pp 16) walks in under a second. This times, median of N runs,
`memcalc.sizing.timeline.timelines` (every stage that bounds memory) and the search for their peak for:

  - each shipped config (DeepSeek-V3's 61 layers on one stage), under its own implementation, each strategy;
  - the same under the transformers implementation (`--impl hf`), where it is walked;
  - each shipped mixture of experts under `--impl hf` with transformers' eager expert loop, walked expert by expert
    (qwen3-30b-a3b: 128 experts in each of 48 layers);
  - each shipped config under torchtitan's pipeline (`--impl torchtitan`, at its own pp and at pp 8 and 16), which
    walks every rank's stage and on each every micro-batch (gpt3-1t: 64 stages of 64 micro-batches).

DeepSeek-V3's full-model walk is its one stage of pp 1, which walks all 61 layers, and under torchtitan's pipeline at
pp 16 its 16 stages (3 dense layers on the first, 4 MoE ones on each of the next 14, 2 on the last), each micro-batch
of each (Megatron's even chunks refuse its dense first layers under pp).

A walk the timeline refuses is listed as such, with its reason. CPU time is what the same run takes on an idle
machine; wall time stretches on a shared one.

    python benchmarks/bench_timeline.py [-n 5] [--check]

--check exits 1 when a median walk takes more than a second of CPU time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from bench_sweep import timed

if TYPE_CHECKING:
    from memcalc.config.schema import ModelConfig
    from memcalc.model.strategy import Strategy

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's memcalc, not the installed one: an A/B runs each checkout's copy
LIMIT = 1.0  # seconds of CPU time for one config's timelines


def cases() -> list[tuple[str, str, dict[str, object]]]:
    """(label, shipped config, overrides) for every walk to time."""
    from memcalc.config.schema import load_config
    from memcalc.config.shipped import shipped_names

    names, eager = shipped_names(), {"impl": "hf", "experts_implementation": "eager"}
    found = []
    for name in names:
        found += [(name, name, {}), (f"{name} --impl hf", name, {"impl": "hf"})]
    found += [(f"{name} --impl hf, eager experts", name, eager) for name in names if load_config(Path(name), {}).moe]
    for name in names:
        own = [{}] if load_config(Path(name), {}).pp > 1 else []
        found += [(f"{name} --impl torchtitan" + "".join(f" --pp {x}" for x in pp.values()), name,
                   {"impl": "torchtitan"} | pp) for pp in (*own, {"pp": 8}, {"pp": 16})]
    return found


def walks(name: str, overrides: dict[str, object]) -> list[tuple[str, Callable[[], object] | str]]:
    """(strategy, the walk of its timelines, or why it is refused) for each strategy the config's t allows."""
    from memcalc.config.schema import load_config
    from memcalc.errors import ConfigError
    from memcalc.model.strategy import STRATEGIES
    from memcalc.sizing.timeline import timelines

    config = load_config(Path(name), overrides)
    found: list[tuple[str, Callable[[], object] | str]] = []
    for strategy in STRATEGIES.values():
        if strategy.tensor_parallel and config.t == 1:
            continue
        try:
            timelines(config, strategy)
        except ConfigError as e:
            found.append((strategy.name, str(e)))
            continue
        found.append((strategy.name, lambda s=strategy: uncached(peak)(config, s)))
    return found


def peak(config: ModelConfig, strategy: Strategy) -> int:
    """What `estimate --totals` reads of the timelines: the bytes of the highest stage's peak."""
    from memcalc.sizing.timeline import timelines

    return max(x.peak.bytes for x in timelines(config, strategy))


def uncached(walk: Callable[..., object]) -> Callable[..., object]:
    """The walk with the timelines' caches of moments emptied first (they spare `none` and `tp` at t = 1 one walk,
    not the runs of a benchmark)."""
    from memcalc.sizing import timeline
    from memcalc.sizing.timeline import hf

    def run(*args: object) -> object:
        hf._moments.cache_clear()
        timeline._moments.cache_clear()
        return walk(*args)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=5, help="runs of each walk")
    parser.add_argument("--check", action="store_true", help=f"exit 1 if a walk takes over {LIMIT} s of CPU time")
    args = parser.parse_args()
    from memcalc.errors import ConfigError

    slow = []
    for label, name, overrides in cases():
        try:
            found = walks(name, overrides)
        except ConfigError as e:
            print(f"{label:<30} not walked: {e}")
            continue
        for strategy, run in found:
            if isinstance(run, str):
                print(f"{label + ' ' + strategy:<30} not walked: {run[:100]}")
                continue
            times = timed(run, args.n)
            wall, cpu = statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)
            print(f"{label + ' ' + strategy:<30} wall {wall:6.3f} s | cpu {cpu:6.3f} s")
            if cpu > LIMIT:
                slow.append(f"{label} {strategy}")
    if args.check and slow:
        print(f"FAIL: over {LIMIT} s of CPU time: {', '.join(slow)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
