"""Files memcalc writes appear whole or not at all.

A sweep of millions of rows takes seconds to write; a SIGTERM, a full disk or a
second sweep writing the same path must never leave a clean-looking half file,
or a file of NUL bytes where the old one was. So every file is written to a
temporary file beside its target (same directory, so same filesystem) and
renamed over it only when complete: rename is atomic on POSIX, and two writers
leave one whole file, the last to finish.

A SIGKILL cannot be caught, so it leaves the temporary behind. Its name says
whose it is: `.rows.csv.memcalc-HOST-PID.RANDOM.part` (the target, memcalc's
mark, the host and process that wrote it). The next write to the same target
removes the leftovers of that target whose writer no longer runs on this host;
a live writer's temporary, another host's (a shared filesystem), and any file
not named this way for this target are never touched.

What stands at the path is kept what it is. A symlink is followed, and its
target written (whole, as above); a file keeps its permission bits (a `chmod 600`
file stays 600). A character device or a FIFO (`/dev/stdout`, `/dev/full`, a
named pipe a reader waits on) is written in place, as a shell's `>` would: a
rename would put a plain file where the device was. Anything else that is not a
regular file (a socket, a directory) is refused. `check_writable` says all of
this before any work is done.
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
    """A binary stream whose bytes become `path` when the block ends without an error.

    On any error (or SystemExit, as SIGTERM becomes in `memcalc.cli.main`) the
    temporary file is removed and `path` is left as it was. A symlink's target is
    written; a device or FIFO is written in place (see the module's docstring).
    """
    target = _target(Path(path))
    mode = _existing_mode(target)
    if mode is not None and _in_place(mode):
        with _in_place_write(target, path) as stream:
            yield stream
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
    """Raise OutputError (one line) unless `atomic_write(path)` can write there, before any work is done.

    For a regular file (or a new one) that means making, and removing, a file in its directory: the
    only test that holds for root, for read-only mounts and for /proc alike.
    """
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
    """SIGTERM and SIGINT wait while a temporary file is made and its name kept.

    A signal between the two would leave a file that nothing removes; held, it arrives a moment later, when
    the name is known and the `except` that removes the file is in force. Held by handlers that note it and
    raise it again, not by the thread's signal mask: the probe's processes run torch's native threads, any of
    which the kernel may hand the signal to, and Python runs its handler in the main thread whatever the mask.
    Handlers can be set in the main thread only; elsewhere no handler interrupts this thread anyway.
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


@contextmanager
def _in_place_write(target: Path, path: Path) -> Iterator[BinaryIO]:
    """The device or FIFO itself, opened for writing (a FIFO waits for its reader, as `>` does)."""
    try:
        with open(target, "wb") as stream:
            yield stream
    except OSError as exc:
        raise _cannot(path, exc) from None


def _cannot(path: Path | str, exc: OSError) -> OutputError:
    return OutputError(f"cannot write {printable(str(path))}: {exc.strerror or exc}")


def _writer_prefix(path: Path) -> str:
    """The start of this host's temporaries for `path`, up to the writer's process id.

    The host is kept to letters, digits and '-', so that the '.' after the id ends it unambiguously.
    """
    host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())
    return f".{path.name}.memcalc-{host}-"


def _remove_leftovers(path: Path) -> None:
    """Remove the temporaries for `path` that a writer on this host left when it was killed.

    Best effort: a leftover that cannot be listed or removed does not stop this write.
    """
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
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
