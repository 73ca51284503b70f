"""How fast `memcalc estimate` starts, next to how long `import sympy` alone takes.

`memcalc estimate` is run in loops and sweeps, so the whole process (interpreter
start, imports, one config file, three strategies, output) must take well under
half of what importing sympy takes. This runs each command N times as a fresh
process and prints min and median wall time, then counts in-process
`memcalc.model.evaluate.estimate` calls per second.

    python benchmarks/bench_estimate.py [-n 10] [--check]

--check exits 1 when the median of `estimate` is not under half the median of
`import sympy`. The machine may be shared: run it a few times, and read the minimum
and the CPU time too.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "gpt3-175b"


def memcalc_command() -> list[str]:
    """The installed console script if there is one, else `python -m memcalc`."""
    script = shutil.which("memcalc")
    return [script] if script else [sys.executable, "-m", "memcalc"]


def process_times(argv: list[str], runs: int) -> tuple[list[float], list[float]]:
    """Wall and CPU (user + system) seconds of each of `runs` fresh processes of `argv`.

    CPU time is the steadier number on a shared machine: waiting for a core adds to
    wall time but not to CPU time.
    """
    walls, cpus = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        walls.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return walls, cpus


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--runs", type=int, default=10, help="processes per command (default 10)")
    parser.add_argument("--check", action="store_true", help="exit 1 unless estimate < 0.5 x import sympy")
    args = parser.parse_args()

    memcalc = memcalc_command()
    commands = {
        "python -c pass (floor)": [sys.executable, "-c", "pass"],
        "memcalc estimate (tables)": [*memcalc, "estimate", "--config", CONFIG],
        "memcalc estimate --json": [*memcalc, "estimate", "--config", CONFIG, "--json"],
        "python -c 'import sympy'": [sys.executable, "-c", "import sympy"],
    }
    print(f"{args.runs} runs each, whole process; memcalc = {' '.join(memcalc)}")
    medians = {}
    for label, argv in commands.items():
        walls, cpus = process_times(argv, args.runs)
        medians[label] = statistics.median(walls)
        print(f"  {label:<28} wall min {min(walls):.3f} s  median {medians[label]:.3f} s"
              f"   cpu min {min(cpus):.3f} s  median {statistics.median(cpus):.3f} s")
    ratio = medians["memcalc estimate (tables)"] / medians["python -c 'import sympy'"]
    print(f"estimate / import sympy (wall medians): {ratio:.2f}  (requirement: well under 0.5)")
    print(f"in-process estimate(): {estimates_per_second():,.0f} calls/s")
    if args.check and ratio >= 0.5:
        sys.exit(1)


if __name__ == "__main__":
    main()
