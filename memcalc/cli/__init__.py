"""The `memcalc` command: a click group whose subcommands load on first use (`estimate` never pays for sympy or torch).

Errors are rendered in one place, `main`: one line on stderr, non-zero exit. Writing nowhere (stdout closed, a full
disk) is an error, exit 1; a reader that stopped reading (`| head`) is not: memcalc stops quietly and exits 0.
"""

from __future__ import annotations

import atexit
import errno
import gc
import importlib
import io
import os
import signal
import sys
import threading
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Iterator

INTERRUPTED = "interrupted"  # the one line a Ctrl-C ends in, exit 130, wherever it lands


def _end_at_once(signum: int, frame: object) -> None:
    """End the process now: a Ctrl-C with its one line and exit 130, a SIGTERM quietly with 143."""
    if signum == signal.SIGINT:
        os.write(2, f"memcalc: error: {INTERRUPTED}\n".encode())  # not sys.stderr: this may interrupt a write to it
    os._exit(128 + signum)


def _set_handlers(handlers: dict[int, Any]) -> dict[int, Any]:
    """Set each signal's handler (main thread only: elsewhere nothing), and return those replaced. An ignored signal
    stays ignored: a shell starts a background job with SIGINT ignored, to spare it the foreground's Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {number: signal.signal(number, handler) for number, handler in handlers.items()
            if signal.getsignal(number) is not signal.SIG_IGN}


# While click and this module load, a Ctrl-C ends memcalc with its one line, not a traceback from inside click; the
# handler that was there is put back at the end of this module.
_WHILE_LOADING = _set_handlers({signal.SIGINT: _end_at_once})

# A young collection every 25,000 new objects, not Python's 700: `memcalc estimate` makes some 20,000 (click's,
# rich's, the model's tables), nearly all living to the end, and would scan them again some thirty times (about 3% of
# its time, benchmarks/bench_estimate.py). A long sweep or fit still collects. `measure` puts Python's own back
# (`python_collection`): the training step it measures runs under it.
_PYTHONS_COLLECTION = gc.get_threshold()
gc.set_threshold(25_000)

import click  # noqa: E402

from memcalc import __version__  # noqa: E402
from memcalc.errors import MemcalcError, debugging  # noqa: E402
from memcalc.text import printable  # noqa: E402

# What is loaded so far lives as long as the process: frozen, no later collection scans it again.
gc.freeze()


def python_collection() -> None:
    """Collect garbage as Python does by default again: a probe in this process measures what a training process,
    under Python's thresholds, holds (a tensor caught in a reference cycle lives until a collection finds it)."""
    gc.set_threshold(*_PYTHONS_COLLECTION)


# name -> (module under memcalc.cli, one-line help shown by `memcalc --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "estimate": ("estimate", "Activation bytes per GPU, per strategy and per tensor."),
    "formula": ("formula", "The per-layer formulas in symbols (text, LaTeX, JSON)."),
    "explain": ("explain", "The ledger: every saved tensor, its shape, split and reason."),
    "measure": ("measure", "Run real layers and compare saved bytes with the ledger."),
    "comm": ("comm", "The collectives TP and SP issue per layer, and the bytes each rank sends."),
    "sweep": ("sweep", "Evaluate many configurations at once (lists and ranges of sizes)."),
    "plot": ("plot", "Plot activation memory against s or t, or a per-tensor breakdown."),
    "fit": ("fit", "The largest micro-batch or sequence, or smallest t, that fits a budget."),
    "configs": ("configs", "The model configs shipped with memcalc, usable as --config NAME."),
    "hf-families": ("hf_families", "The Hugging Face families --hf-config reads, with the layer each was measured on."),
}


_NOTES: list[str] = []  # stderr lines that wait for the command to succeed (`note`)


def note(line: str) -> None:
    """A line for stderr (what --hf-config read, a layout left out, what a sweep skipped), printed when the command
    ends without an error: on bad input the error is the one line."""
    _NOTES.append(line)


class _ReaderGone(Exception):
    """stdout's reader closed the pipe. Not an OSError, so click, which exits 1 on EPIPE, lets it reach `main`."""


class _Interrupted(Exception):
    """Ctrl-C. Not a KeyboardInterrupt, so click (which prints a blank line and aborts) lets it reach `main`."""


@contextmanager
def _reader_gone_past_click() -> Iterator[None]:
    """Carry a closed pipe and a Ctrl-C past click's own handling, to `main` and its rules for them."""
    try:
        yield
    except BrokenPipeError:
        raise _ReaderGone from None
    except KeyboardInterrupt:
        raise _Interrupted from None


class LazyGroup(click.Group):
    """A group that imports a subcommand's module only when that command runs."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Parse as click does; `memcalc --help` and `--version` print from here."""
        with _reader_gone_past_click():
            return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> object:
        """Run the subcommand as click does; everything it prints, its --help too, is printed from here."""
        with _reader_gone_past_click():
            return super().invoke(ctx)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        return importlib.import_module(f"memcalc.cli.{COMMANDS[name][0]}").command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # List commands from the table, so --help imports none of them.
        with formatter.section("Commands"):
            formatter.write_dl([(name, text) for name, (_, text) in COMMANDS.items()])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["--help"]})
@click.version_option(__version__, prog_name="memcalc")
def cli() -> None:
    """How much activation memory each GPU keeps for backward, and why.

    Strategies: none (no parallelism), tp (tensor parallel) and tp-sp (tensor + sequence parallel), as in Megatron-LM
    (Korthikanti et al. 2022). Exit codes: 0 ok (also when a reader such as head stops early), 1 a measurement
    disagreed, a worker failed or stdout could not be written, 2 bad input, 3 nothing fits (estimate --totals, fit), 130
    Ctrl-C. Set MEMCALC_DEBUG=1 to see tracebacks.
    """


def main(argv: list[str] | None = None) -> None:
    """Run the CLI, turning every expected failure into one line on stderr. Without `argv` (the console script,
    `python -m memcalc`) it is the process's command line: once it has run without an error (exit 0, or 3: nothing
    fits), the process ends with that code, and exit work registered before memcalc.cli loaded never runs
    (`_end_without_teardown`). A program that calls main and goes on passes `argv`."""
    debug = debugging()
    _tolerant_streams()
    _NOTES.clear()
    try:
        # SIGTERM as SystemExit(143) and Ctrl-C as _CtrlC, so that `finally` blocks remove temporary files and stop
        # spawned workers.
        with _signals_handled({signal.SIGTERM: _exit_on_sigterm, signal.SIGINT: _raise_ctrl_c}):
            code = cli.main(args=argv, prog_name="memcalc", standalone_mode=False)
            sys.stdout.flush()  # now, so a full disk or a closed pipe is reported here rather than lost at exit
            for line in _NOTES:
                click.echo(line, err=True)
    except click.exceptions.NoArgsIsHelpError as exc:  # a bare `memcalc`: the help as click prints it
        exc.show()
        sys.exit(exc.exit_code)
    except MemcalcError as exc:
        if debug:
            raise
        _fail(str(exc), exc.exit_code)
    except click.UsageError as exc:
        hint = f" (see 'memcalc {exc.ctx.info_name} --help')" if exc.ctx and exc.ctx.parent else ""
        _fail(f"{exc.format_message()}{hint}", exc.exit_code)
    except click.ClickException as exc:
        _fail(exc.format_message(), exc.exit_code)
    except (click.Abort, KeyboardInterrupt, _Interrupted):  # Ctrl-C: what was started has been stopped
        _fail(INTERRUPTED, 128 + signal.SIGINT)
    except (BrokenPipeError, _ReaderGone):  # the reader stopped reading (`| head`): not an error, nothing to say
        _silence_stdout()
        code = 0
    except OSError as exc:  # domain code turns its own I/O errors into MemcalcError: this is output
        if debug:
            raise
        _silence_stdout()
        _fail(f"cannot write output: {exc.strerror or exc}", 1)
    except Exception as exc:  # a bug: still one line unless debugging
        if debug:
            raise
        _fail(f"internal error: {type(exc).__name__}: {exc} (set MEMCALC_DEBUG=1 for the traceback)", 70)
    code = code if isinstance(code, int) else 0
    if argv is None:  # the process's own command line: it ends here
        _FINISHED.append(code)
    sys.exit(code)


_FINISHED: list[int] = []  # the exit code of the command this process ran, once it has run (`main`)


def _end_without_teardown() -> None:
    """At exit, once the process's command has run: end as soon as its output is flushed. Python would free every
    object of every loaded module one by one first (about 5% of `memcalc estimate`, benchmarks/bench_estimate.py).
    Registered when this module loads, before anything else memcalc loads registers, so it runs after what those
    registered (multiprocessing's and tempfile's clean-ups); exit work registered before this module loaded (the
    calling program's, a coverage tool's) never runs. A flush that fails is left to Python, and so is a process that
    loaded torch (`measure`), whose C++ side has its own work at exit."""
    if not _FINISHED or "torch" in sys.modules:
        return
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return
    os._exit(_FINISHED[-1])


atexit.register(_end_without_teardown)


def echo_json(doc: object) -> None:
    """Print a JSON document: the one place memcalc writes JSON to stdout. NaN and infinity are not JSON, so a
    non-finite number is a bug (inputs are finite at the parameter) and fails here rather than reach a parser."""
    import json

    click.echo(json.dumps(doc, indent=2, allow_nan=False))


def json_document(config: Any = None, **fields: Any) -> dict[str, Any]:
    """A command's JSON document: `schema_version` first, then the config it ran (a ModelConfig, where it has one)
    as `memcalc.config.schema.config_record` writes it, then `fields` (the schema tables load only for JSON)."""
    from memcalc.config.schema import config_record
    from memcalc.schemas import SCHEMA_VERSION

    head = {"schema_version": SCHEMA_VERSION}
    return head | ({"config": config_record(config)} if config is not None else {}) | fields


def _fail(message: str, code: int) -> None:
    """One line on stderr: whitespace folded, control characters escaped, never a flood."""
    line = printable(" ".join(message.split()))
    click.echo(f"memcalc: error: {line if len(line) <= 2000 else line[:1997] + '...'}", err=True)
    sys.exit(code)


class _ClosedStdout(io.TextIOBase):
    """What sys.stdout is when the shell closed it (`>&-`): every write fails, as writing to fd 1 would."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, "stdout is closed")


def _tolerant_streams() -> None:
    """A closed stdout fails on write instead of swallowing output; an encoding that cannot
    show a character (PYTHONIOENCODING=ascii and a name with an accent) writes its escape."""
    if sys.stdout is None:
        sys.stdout = _ClosedStdout()
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null, so Python's own flush at exit has nowhere to fail."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass  # stdout has no file descriptor (a test's StringIO, or closed): nothing will flush at exit


@contextmanager
def _signals_handled(handlers: dict[int, Any]) -> Iterator[None]:
    """`handlers` in force for the block (in the main thread), the previous ones after it."""
    previous = _set_handlers(handlers)
    try:
        yield
    finally:
        _set_handlers(previous)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


class _CtrlC(KeyboardInterrupt):
    """A Ctrl-C that every `except KeyboardInterrupt` catches but CPython does not note by its exact type: a noted
    one (ending code run from a string, such as dataclasses' generated methods) makes `python -m memcalc` end by
    SIGINT (-2) at exit even after memcalc chose exit 130."""


def _raise_ctrl_c(signum: int, frame: object) -> None:
    raise _CtrlC


def signals_end_at_once() -> AbstractContextManager[None]:
    """For a block: Ctrl-C and SIGTERM end this process where they land (exit 130, with its one line, and 143).

    For `memcalc measure`, which runs torch and other people's code: an exception raised there may be swallowed
    (numpy's init clears a KeyboardInterrupt) or leave a half-imported module. Nothing needs unwinding: the workers
    and the forkserver watch this process's pipes and leave with it.
    """
    return _signals_handled({signal.SIGINT: _end_at_once, signal.SIGTERM: _end_at_once})


_set_handlers(_WHILE_LOADING)
