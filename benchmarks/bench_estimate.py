"""How fast `memcalc estimate` starts, next to how long `import sympy` alone takes.

`memcalc estimate` is run in loops and sweeps, so the whole process (interpreter
start, imports, one config file, three strategies, output) must take at most 0.3x
of what importing sympy takes (issue 22). Each round runs every command once as a
fresh process, in turn, so that a busy machine slows all of them alike (paired
runs); the ratio is the median over rounds of estimate / import sympy, of wall and
of CPU time. Then it counts in-process `memcalc.model.evaluate.estimate` calls per second.

Both sides run from cached bytecode, as an installed package does: the processes get
a private PYTHONPYCACHEPREFIX (filled by a first, untimed run of each command) and
no PYTHONDONTWRITEBYTECODE, which would otherwise have memcalc's own modules
compiled from source in every process while sympy's come precompiled by pip.

    python benchmarks/bench_estimate.py [-n 10] [--check]

--check states the bar and the median paired wall ratio, and exits 1 when the ratio
is above 0.3. The machine may be shared: run it a few times, and read the CPU ratio
too (steadier under load).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "gpt3-175b"


def memcalc_command() -> list[str]:
    """The console script beside this interpreter (a virtualenv's), else on PATH, else `python -m memcalc`."""
    beside = Path(sys.executable).parent / "memcalc"
    script = str(beside) if beside.is_file() else shutil.which("memcalc")
    return [script] if script else [sys.executable, "-m", "memcalc"]


def bytecode_env(cache: str) -> dict[str, str]:
    """This environment, with bytecode read from and written to `cache`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return env | {"PYTHONPYCACHEPREFIX": cache}


def process_time(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of one fresh process of `argv`.

    CPU time is the steadier number on a shared machine: waiting for a core adds to
    wall time but not to CPU time.
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def paired_times(
    commands: dict[str, list[str]], rounds: int, env: dict[str, str]
) -> dict[str, list[tuple[float, float]]]:
    """(wall, cpu) of each command in each round; every round runs each command once, in turn."""
    for argv in commands.values():  # untimed: fills the bytecode cache
        subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, env=env)
    times: dict[str, list[tuple[float, float]]] = {label: [] for label in commands}
    for _ in range(rounds):
        for label, argv in commands.items():
            times[label].append(process_time(argv, env))
    return times


def estimates_per_second(seconds: float = 1.0) -> float:
    """In-process `estimate` calls per second: one config, the three strategies in turn."""
    sys.path.insert(0, str(ROOT))
    from memcalc.config.schema import load_config
    from memcalc.model.evaluate import estimate
    from memcalc.model.strategy import STRATEGIES

    config = load_config(Path(CONFIG), {})  # a shipped config, by name
    strategies = list(STRATEGIES.values())
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        estimate(config, strategies[calls % len(strategies)])
        calls += 1
    return calls / (time.perf_counter() - start)


ESTIMATE, SYMPY = "memcalc estimate (tables)", "python -c 'import sympy'"
LIMIT = 0.3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--runs", type=int, default=10, help="rounds: processes per command (default 10)")
    parser.add_argument("--check", action="store_true", help=f"exit 1 unless estimate <= {LIMIT} x import sympy")
    args = parser.parse_args()

    memcalc = memcalc_command()
    commands = {
        "python -c pass (floor)": [sys.executable, "-c", "pass"],
        ESTIMATE: [*memcalc, "estimate", "--config", CONFIG],
        "memcalc estimate --json": [*memcalc, "estimate", "--config", CONFIG, "--json"],
        SYMPY: [sys.executable, "-c", "import sympy"],
    }
    print(f"{args.runs} paired rounds, whole processes, cached bytecode; memcalc = {' '.join(memcalc)}")
    with tempfile.TemporaryDirectory() as cache:
        times = paired_times(commands, args.runs, bytecode_env(cache))
    for label, runs in times.items():
        walls, cpus = [w for w, _ in runs], [c for _, c in runs]
        print(f"  {label:<28} wall min {min(walls):.3f} s  median {statistics.median(walls):.3f} s"
              f"   cpu min {min(cpus):.3f} s  median {statistics.median(cpus):.3f} s")
    ratios = [tuple(e / s for e, s in zip(est, sym)) for est, sym in zip(times[ESTIMATE], times[SYMPY])]
    wall = statistics.median(r[0] for r in ratios)
    cpu = statistics.median(r[1] for r in ratios)
    print(f"estimate / import sympy, median of paired ratios: wall {wall:.2f}, cpu {cpu:.2f}"
          f"  (requirement: <= {LIMIT})")
    print(f"in-process estimate(): {estimates_per_second():,.0f} calls/s")
    if args.check:
        verdict = "pass" if wall <= LIMIT else "FAIL"
        print(f"check (issue 22): estimate <= {LIMIT}x import sympy, median paired wall ratio {wall:.3f}: {verdict}")
        sys.exit(0 if wall <= LIMIT else 1)


if __name__ == "__main__":
    main()
