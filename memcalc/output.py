"""Files memcalc writes appear whole or not at all.

A sweep of millions of rows takes seconds to write; a SIGTERM, a full disk or a
second sweep writing the same path must never leave a clean-looking half file,
or a file of NUL bytes where the old one was. So every file is written to a
temporary file beside its target (same directory, so same filesystem) and
renamed over it only when complete: rename is atomic on POSIX, and two writers
leave one whole file, the last to finish.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
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
    try:
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
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
