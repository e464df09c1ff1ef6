"""Reading and writing PyTorch `.pt` files (state dicts, nanoGPT `ckpt.pt`).

PyTorch is an optional dependency: it is imported only here, when a `.pt` file is
read or written, and its absence is reported as one clear error.
"""

import contextlib
import importlib.util
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from jaxport.errors import JaxportError, os_error, write_error


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def _torch():
    try:
        import torch
    except ImportError as err:
        raise JaxportError(
            "reading or writing PyTorch .pt files needs PyTorch: pip install 'jaxport[torch]' (torch==2.13.0)"
        ) from err
    return torch


def load_torch_file(path: str | os.PathLike, what: str = "checkpoint") -> dict:
    """Load a `torch.save` file on the CPU with tensors turned into numpy arrays.

    bfloat16 tensors become `ml_dtypes.bfloat16` arrays. Errors name the file and say
    whether it is missing, truncated or not a PyTorch file.
    """
    path = Path(path)
    if not path.exists():
        raise JaxportError(f"{what} not found: {path}")
    if path.is_dir():
        raise JaxportError(f"{what} path is a directory, expected a file written by torch.save: {path}")
    if path.stat().st_size == 0:
        raise JaxportError(f"{what} file is empty: {path}")
    if not zipfile.is_zipfile(path):
        raise JaxportError(
            f"{what} file is truncated or not a PyTorch checkpoint (no complete torch.save zip archive): {path}"
        )
    # torch.load does not check the archive's CRCs, so damaged tensor bytes would load silently.
    with zipfile.ZipFile(path) as archive:
        damaged = archive.testzip()
    if damaged is not None:
        raise JaxportError(
            f"{what} file is corrupt or truncated: {path} (archive member {damaged} fails its CRC check)"
        )
    torch = _torch()
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types for damaged archives
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise JaxportError(f"{what} file is corrupt or truncated and cannot be read: {path} ({first_line})") from None
    return _to_numpy(obj, torch)


def _to_numpy(obj, torch):
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        if t.dtype == torch.bfloat16:
            import ml_dtypes

            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    if isinstance(obj, dict):  # OrderedDict stays one, as state dicts are
        return type(obj)((k, _to_numpy(v, torch)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_numpy(v, torch) for v in obj)
    return obj


def _to_torch(obj, torch):
    if isinstance(obj, dict):
        return type(obj)((k, _to_torch(v, torch)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_torch(v, torch) for v in obj)
    if hasattr(obj, "__array__") and not isinstance(obj, (int, float, bool, str)):  # numpy and jax arrays
        arr = np.array(obj, copy=True, order="C")  # torch needs a writable buffer
        if arr.dtype.name == "bfloat16":
            return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(arr)
    return obj


_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once at import: changing it later, while other threads create files, would race


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike):
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds,
    so a crash never leaves a half-written file under the final name. A write that fails (a full disk:
    numpy and torch say so as OSError or RuntimeError) is one JaxportError naming `path`."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise os_error(err) from None
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_UMASK)  # the mode an ordinary open() gives, not mkstemp's 0600
    try:
        yield Path(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:
        raise write_error(err, path, written=tmp) from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save_torch_file(obj, path: str | os.PathLike) -> None:
    """`torch.save` of `obj` with numpy arrays turned into tensors, written atomically."""
    torch = _torch()
    with atomic_write(path) as tmp:
        torch.save(_to_torch(obj, torch), tmp)


def strip_prefix(state_dict: dict, prefix: str) -> dict:
    """Drop `prefix` from every key that has it (e.g. torch.compile's `_orig_mod.`)."""
    return {(k[len(prefix) :] if k.startswith(prefix) else k): v for k, v in state_dict.items()}
