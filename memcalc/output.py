"""Files memcalc writes appear whole or not at all: a SIGTERM, a full disk or a second writer never leaves a half file.

Each file is written to a temporary beside its target and renamed over it when complete (atomic on POSIX). A
SIGKILL's leftover is named `.rows.csv.memcalc-HOST-PID.RANDOM.part`; the next write to that target removes the
ones whose writer no longer runs on this host. A symlink's target is written, a file keeps its permission bits, a
character device or FIFO (`/dev/stdout`, a named pipe) is written in place as `>` would; anything else is refused.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import stat
import tempfile
import threading
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO, Iterator

from memcalc.errors import MemcalcError
from memcalc.text import printable


class OutputError(MemcalcError):
    """A file could not be written (exit 1: the input was fine, the output was not)."""

    exit_code = 1


@contextmanager
def atomic_write(path: Path) -> Iterator[BinaryIO]:
    """A binary stream whose bytes become `path` when the block ends without an error (SystemExit, as SIGTERM
    becomes, included): on an error the temporary is removed and `path` left as it was."""
    target = _target(Path(path))
    mode = _existing_mode(target)
    if mode is not None and _in_place(mode):  # the device or FIFO itself (a FIFO waits for its reader, as `>` does)
        try:
            with open(target, "wb") as stream:
                yield stream
        except OSError as exc:
            raise _cannot(path, exc) from None
        return
    _remove_leftovers(target)
    temporary = None
    try:
        with _signals_held():
            fd, temporary = _temporary_beside(target, path)
        with os.fdopen(fd, "wb") as stream:
            yield stream
            stream.flush()
            os.fsync(stream.fileno())
        # mkstemp makes 0600: an existing file keeps its own bits, a new one gets what a plain open() would give
        os.chmod(temporary, stat.S_IMODE(mode) if mode is not None else 0o666 & ~_umask())
        os.replace(temporary, target)
    except OSError as exc:
        _remove(temporary)
        raise _cannot(path, exc) from None
    except BaseException:
        if temporary is not None:
            _remove(temporary)
        raise


def check_writable(path: Path) -> None:
    """Raise OutputError (one line) unless `atomic_write(path)` can write there, before any work is done: by making
    and removing a file beside it, the only test that holds for root, read-only mounts and /proc alike."""
    target = _target(Path(path))
    mode = _existing_mode(target)
    if mode is not None and not os.access(target, os.W_OK):  # a read-only file is not replaced behind its back
        raise OutputError(f"cannot write {printable(str(path))}: Permission denied")
    if mode is not None and _in_place(mode):
        return
    with _signals_held():  # named as a temporary is, so even a SIGKILL's leftover is cleaned up
        fd, probe = _temporary_beside(target, path)
        os.close(fd)
        _remove(probe)


def _temporary_beside(target: Path, path: Path) -> tuple[int, str]:
    """A new temporary file in `target`'s directory, named as this writer's (see the module's docstring)."""
    try:
        return tempfile.mkstemp(dir=target.parent, prefix=f"{_writer_prefix(target)}{os.getpid()}.", suffix=".part")
    except OSError as exc:
        raise _cannot(path, exc) from None


@contextmanager
def _signals_held() -> Iterator[None]:
    """SIGTERM and SIGINT wait while a temporary file is made and its name kept, so nothing leaves it unremoved.

    Held by handlers that note and re-raise them, not by the signal mask: torch's native threads may be handed the
    signal whatever this thread's mask, and Python runs the handler in the main thread (the only place one is set).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    held = (signal.SIGTERM, signal.SIGINT)
    previous = {number: signal.signal(number, lambda n, _: caught.append(n)) for number in held}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        for number in caught:
            signal.raise_signal(number)


def _target(path: Path) -> Path:
    """Where the bytes go: a symlink's final target (which may not exist yet), else `path` itself."""
    return Path(os.path.realpath(path)) if os.path.islink(path) else path


def _existing_mode(target: Path) -> int | None:
    """The st_mode of what stands at `target`, None if nothing does; OutputError for what cannot be written."""
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _cannot(target, exc) from None
    if not (stat.S_ISREG(mode) or _in_place(mode)):
        kind = "a directory" if stat.S_ISDIR(mode) else "neither a regular file nor a character device or FIFO"
        raise OutputError(f"cannot write {printable(str(target))}: it is {kind}")
    return mode


def _in_place(mode: int) -> bool:
    """A character device or a FIFO: written where it stands, never replaced by a file."""
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


def _cannot(path: Path | str, exc: OSError) -> OutputError:
    return OutputError(f"cannot write {printable(str(path))}: {exc.strerror or exc}")


def _writer_prefix(path: Path) -> str:
    """The start of this host's temporaries for `path`, up to the writer's process id (the host kept to letters,
    digits and '-', so the '.' after the id ends it unambiguously)."""
    host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())
    return f".{path.name}.memcalc-{host}-"


def _remove_leftovers(path: Path) -> None:
    """Remove the temporaries for `path` that a killed writer on this host left (best effort: never stops a write)."""
    leftover = re.compile(re.escape(_writer_prefix(path)) + r"([1-9][0-9]*)\.[a-z0-9_]+\.part")
    try:
        names = os.listdir(path.parent)
    except OSError:
        return  # mkstemp, next, names what is wrong with the directory
    for name in names:
        found = leftover.fullmatch(name)
        if found and not _runs(int(found.group(1))):
            with suppress(OSError):  # removed by another writer meanwhile, or not ours to remove: left
                os.unlink(path.parent / name)


def _runs(pid: int) -> bool:
    """Whether process `pid` runs on this host; another user's counts, and so does an id too large to ask about."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        pass
    return True


def _umask() -> int:
    """The process's umask (reading it means setting it, so it is set straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _remove(path: str) -> None:
    with suppress(FileNotFoundError):
        os.unlink(path)
