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
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
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
    temporary file is removed and `path` is left as it was.
    """
    path = Path(path)
    _remove_leftovers(path)
    try:
        prefix = f"{_writer_prefix(path)}{os.getpid()}."
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=prefix, suffix=".part")
    except OSError as exc:
        raise OutputError(f"cannot write {printable(str(path))}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as stream:
            yield stream
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(temporary, 0o666 & ~_umask())  # mkstemp makes 0600; a plain open() would not
        os.replace(temporary, path)
    except OSError as exc:
        _remove(temporary)
        raise OutputError(f"cannot write {printable(str(path))}: {exc.strerror or exc}") from None
    except BaseException:
        _remove(temporary)
        raise


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
