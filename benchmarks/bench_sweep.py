"""How many configurations per second `memcalc sweep` evaluates and writes.

The sweep of the issue, GPT-3 175B with --b 1:100 --s 64:640000:64, is a
million points; under one strategy that is a million configurations (rows),
under all three three million. This prints, best and median of N runs:

  - evaluation alone (`memcalc.sizing.sweep.evaluate_sweep`, in-process);
  - writing the CSV alone (`csv_chunks`, in-process, into memory);
  - the whole command as a fresh process writing the CSV to a file
    (interpreter start, imports, evaluation, writing).

Each line gives wall time and CPU time (user + system). On a machine shared
with other work the wall time stretches while the CPU time stays put: the CPU
time is what the same run takes on an idle machine.

    python benchmarks/bench_sweep.py [-n 3] [--check]

--check exits 1 when the median evaluation of a million configurations takes
more than a second of wall time. The machine may be shared: run it a few times and read
the best times too.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "gpt3-175b"
RANGES = ["--b", "1:100", "--s", "64:640000:64"]


def _cpu() -> float:
    """CPU seconds of this process and of its finished children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed(run: Callable[[], object], runs: int) -> list[tuple[float, float]]:
    """(wall, cpu) seconds of each run."""
    times = []
    for _ in range(runs):
        wall, cpu = time.perf_counter(), _cpu()
        run()
        times.append((time.perf_counter() - wall, _cpu() - cpu))
    return times


def report(label: str, rows: int, times: list[tuple[float, float]]) -> float:
    """Print medians (and the best wall time) as configurations per second; return the median wall time."""
    wall = statistics.median(t[0] for t in times)
    cpu = statistics.median(t[1] for t in times)
    best = min(t[0] for t in times)
    print(f"{label:<42} {rows:>9,} rows | wall {wall:6.3f} s (best {best:6.3f}) {rows / wall:>11,.0f}/s"
          f" | cpu {cpu:6.3f} s {rows / cpu:>11,.0f}/s")
    return wall


def in_process(strategies: list[str], runs: int) -> float:
    """Evaluation, then CSV encoding, in this process; returns the median evaluation time."""
    sys.path.insert(0, str(ROOT))
    from memcalc.config.schema import load_yaml
    from memcalc.model.knobs import Accounting
    from memcalc.model.strategy import STRATEGIES
    from memcalc.sizing.sweep import evaluate_sweep, make_sweep, parse_values
    from memcalc.cli.sweep_output import csv_chunks

    ranges = {RANGES[i][2:]: parse_values(RANGES[i + 1]) for i in range(0, len(RANGES), 2)}
    sweep = make_sweep(load_yaml(Path(CONFIG)), ranges, [STRATEGIES[n] for n in strategies], Accounting())
    result = evaluate_sweep(sweep)
    label = "+".join(strategies)
    evaluation = report(f"evaluate ({label})", sweep.rows, timed(lambda: evaluate_sweep(sweep), runs))
    report(f"encode CSV ({label})", result.rows, timed(lambda: b"".join(c for _, c in csv_chunks(result)), runs))
    return evaluation


def whole_command(strategies: list[str], runs: int) -> None:
    """`python -m memcalc sweep ... --out FILE.csv` as a fresh process each run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sweep.csv"
        argv = [sys.executable, "-m", "memcalc", "sweep", "--config", CONFIG, *RANGES, "--out", str(out)]
        for name in strategies:
            argv += ["--strategy", name]
        times = timed(lambda: subprocess.run(argv, cwd=ROOT, check=True), runs)
        rows = sum(1 for _ in out.open()) - 1
    report(f"whole command, CSV file ({'+'.join(strategies)})", rows, times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=3, help="runs of each measurement")
    parser.add_argument("--check", action="store_true", help="exit 1 if evaluating 1e6 configurations takes over 1 s")
    args = parser.parse_args()
    print(f"GPT-3 175B, {' '.join(RANGES)}; {args.n} runs each")
    one = in_process(["tp-sp"], args.n)
    in_process(["none", "tp", "tp-sp"], args.n)
    whole_command(["tp-sp"], args.n)
    whole_command(["none", "tp", "tp-sp"], args.n)
    if args.check and one > 1.0:
        print(f"FAIL: evaluating a million configurations took {one:.2f} s (median), over 1 s")
        sys.exit(1)


if __name__ == "__main__":
    main()
