"""Every --json output is JSON to a strict parser, whatever numbers the flags were given (issue 22).

Hypothesis draws a command and hostile numbers for its flags: the smallest and largest values a flag takes, values
next to a rule's edge, sizes whose bytes come near 2^63. Each run either prints a document that `json.loads` reads
with NaN and Infinity refused (exit 0, or 3 where estimate's totals do not fit), or refuses its input in one line
(exit 2, or 3 where nothing fits): never a traceback, never exit 70, never a number JSON has not got.
"""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from . import memcalc_cli

WHOLE = ["1", "2", "3", "7", "64", "96", "2048", "65536", "1048576", "4611686018427387904", "9223372036854775807",
         "0", "-1"]
REAL = ["1e-300", "1e-9", "0.5", "1", "3.14159", "1e6", "1e300", "0", "-1", "1.7976931348623157e308"]
PROBABILITY = ["0", "1e-300", "0.1", "0.5", "0.999999999999", "1"]
SIZE = ["1", "1B", "1KiB", "80GiB", "1024GiB", "8EiB", "9223372036854775807", "0"]

MODELS = {"tiny": ["--config", "tiny"], "gpt3-175b": ["--config", "gpt3-175b"],
          "mixtral": ["--config", "gpt3-175b", "--num-experts", "8", "--moe-router-topk", "2"]}

# command -> (its fixed arguments, {flag: the hostile values it is drawn from})
COMMANDS = {
    "estimate": (["estimate", "--json"], {
        "--b": WHOLE, "--s": WHOLE, "--t": WHOLE, "--L": WHOLE, "--dropout": PROBABILITY,
        "--device-memory": SIZE, "--reserve": SIZE}),
    "comm": (["comm", "--json"], {
        "--b": WHOLE, "--s": WHOLE, "--t": WHOLE, "--num-microbatches": WHOLE, "--peak-tflops": REAL,
        "--link-gbps": REAL}),
    "comm --overlap": (["comm", "--overlap", "default", "--json"], {
        "--b": WHOLE, "--s": WHOLE, "--t": WHOLE, "--peak-tflops": REAL, "--link-gbps": REAL, "--num-splits": WHOLE}),
    "fit": (["fit", "--json"], {"--budget": SIZE, "--b": WHOLE, "--s": WHOLE, "--t": WHOLE, "--L": WHOLE}),
    "formula": (["formula", "--format", "json"], {"--dropout": PROBABILITY}),
    "sweep": (["sweep", "--format", "json"], {"--b": WHOLE[:6], "--s": ["1,2", "64:640:64", "1:8:x2", *WHOLE[:6]],
                                               "--t": ["1,2,4,8", *WHOLE[:5]], "--dropout": PROBABILITY}),
}


@st.composite
def runs(draw: st.DrawFn) -> list[str]:
    """A command with a model and some of its flags set to hostile values."""
    name = draw(st.sampled_from(sorted(COMMANDS)))
    fixed, flags = COMMANDS[name]
    model = [] if name == "formula" else MODELS[draw(st.sampled_from(sorted(MODELS)))]
    chosen = draw(st.lists(st.sampled_from(sorted(flags)), unique=True, max_size=4))
    return [*fixed, *model, *(part for flag in chosen for part in (flag, draw(st.sampled_from(flags[flag]))))]


def _refuse(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs())
def test_every_json_output_is_strict_json_or_one_line_of_refusal(args):
    run = memcalc_cli(*args)
    assert run.code in (0, 2, 3), (args, run)
    if run.out:  # 0, or 3 where estimate's totals say what does not fit
        assert run.code != 2
        json.loads(run.out, parse_constant=_refuse)
        return
    assert run.code != 0, (args, run)
    assert run.err.startswith("memcalc: error: ") and run.err.count("\n") == 1, run.err  # notes wait for success
