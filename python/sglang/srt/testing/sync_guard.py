"""A guard that fails on device->host reads made by our code inside a region (the forward).

On a GPU, `torch.cuda.set_sync_debug_mode("error")` catches every synchronising call. On CPU
there is no device, so the guard patches the Python entry points that read tensor values back
(`.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `bool()/int()/float()` of a tensor, `nonzero`,
`unique`, boolean-mask indexing) and raises when the caller is sglang or sgl_kernel code. Calls
made by Triton's interpreter itself (it runs kernels on host copies) are not ours and pass.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Iterator

import torch


class HostSyncError(RuntimeError):
    pass


@functools.lru_cache(maxsize=1)
def _roots() -> tuple[str, ...]:
    import sgl_kernel
    import sglang

    return tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (sglang, sgl_kernel))


def _ours(frame) -> bool:
    fn = os.path.abspath(frame.f_code.co_filename)
    # sgl_kernel/utils.py holds the interpreter's own shims (host arithmetic by design on CPU).
    return fn.startswith(_roots()) and not fn.endswith(("sync_guard.py", f"sgl_kernel{os.sep}utils.py"))


def _wrap(name: str, original):
    def guarded(*args, **kwargs):
        caller = sys._getframe(1)
        if _ours(caller) and (name != "__getitem__" or _bool_index(args)):
            where = f"{caller.f_code.co_filename}:{caller.f_lineno}"
            raise HostSyncError(f"{name} reads a tensor back to the host inside the forward ({where})")
        return original(*args, **kwargs)

    return guarded


def _bool_index(args) -> bool:
    idx = args[1] if len(args) > 1 else None
    items = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


_TENSOR_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
                   "unique", "__getitem__")
_TORCH_FUNCS = ("nonzero", "unique", "masked_select", "bincount")


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Inside: our code may not read device values back (GPU: CUDA sync debug mode as well)."""
    saved_t = {n: getattr(torch.Tensor, n) for n in _TENSOR_METHODS}
    saved_f = {n: getattr(torch, n) for n in _TORCH_FUNCS}
    cuda = torch.cuda.is_available()
    try:
        for n, f in saved_t.items():
            setattr(torch.Tensor, n, _wrap(n, f))
        for n, f in saved_f.items():
            setattr(torch, n, _wrap(n, f))
        if cuda:
            torch.cuda.set_sync_debug_mode("error")
        yield
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
        for n, f in saved_t.items():
            setattr(torch.Tensor, n, f)
        for n, f in saved_f.items():
            setattr(torch, n, f)
