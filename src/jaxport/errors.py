"""The one exception type users see for bad input, and one-line accounts of failed file writes."""

import errno
import os
import re
import resource
import shutil
from pathlib import Path


class JaxportError(Exception):
    """Bad input (path, file, key, shape, config value): the message says what to fix."""


_DISK_FULL = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EFBIG: "the file would exceed the file system's (or `ulimit -f`'s) size limit",
}


def os_error(err: OSError, path: str | os.PathLike | None = None) -> JaxportError:
    """`err`, from creating or writing `path` (default: the path the error names), as one line that says what
    stands in the way: a file where a folder should be, a full disk, missing permissions."""
    if not (path or err.filename):
        return JaxportError(f"cannot write a file: {err.strerror or err}")
    path = Path(path or err.filename)
    if err.errno in (errno.ENOTDIR, errno.EEXIST):
        blocker = next((p for p in (path, *path.parents) if p.is_file()), None)
        if blocker is not None:
            return JaxportError(
                f"cannot create {path}: {blocker} is a file, not a folder; choose another output path "
                f"or move that file away"
            )
    if err.errno in _DISK_FULL:
        return JaxportError(f"cannot write {path}: {_DISK_FULL[err.errno]}; free some space or write elsewhere")
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return JaxportError(f"cannot write {path}: {err.strerror}; choose a folder you can write to")
    return JaxportError(f"{path}: {err.strerror or err}")


def write_error(err: BaseException, path: str | os.PathLike, written: str | os.PathLike | None = None) -> JaxportError:
    """A failed write of `path` (through the file `written`, e.g. a temporary one) in one line. numpy, torch
    and tensorstore (orbax) report a full disk without an errno, or with it inside their message, so the
    cause is read from the message or, failing that, from the disk itself (free space, the file-size limit)."""
    code = getattr(err, "errno", None)
    found = re.search(r"os[_ ]error(?:_code=)?'? ?(\d+)", str(err))  # tensorstore's and safetensors' ways
    if code is None and found:
        code = int(found.group(1))
    if code is None:
        code = _disk_full_now(Path(written or path))
    if code is not None:
        return os_error(OSError(code, os.strerror(code)), path)
    text = str(err).strip()
    return JaxportError(f"cannot write {path}: {text.splitlines()[0][:300] if text else type(err).__name__}")


def _disk_full_now(path: Path) -> int | None:
    """ENOSPC when the disk holding `path` is (nearly) full, EFBIG when `path` reached the file-size limit."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and path.is_file() and path.stat().st_size >= limit:
        return errno.EFBIG
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and shutil.disk_usage(existing).free < 1 << 20:
        return errno.ENOSPC
    return None
