"""Guards that fail on device->host reads made by our code inside a region (the forward), and on
what a CUDA-graph capture cannot hold (`capture_guard`).

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

    sglang_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # sglang/srt/testing/
    return tuple(d + os.sep for d in (sglang_dir, os.path.dirname(os.path.abspath(sgl_kernel.__file__))))


def _ours(frame) -> bool:
    fn = os.path.abspath(frame.f_code.co_filename)
    # sgl_kernel/utils.py holds the interpreter's own shims (host arithmetic by design on CPU).
    return fn.startswith(_roots()) and not fn.endswith(("sync_guard.py", f"sgl_kernel{os.sep}utils.py"))


_allowed = 0  # > 0 inside host_sync_allowed()


def _wrap(name: str, original):
    def guarded(*args, **kwargs):
        caller = sys._getframe(1)
        if not _allowed and _ours(caller) and (name != "__getitem__" or _bool_index(args)):
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


@contextlib.contextmanager
def host_sync_allowed() -> Iterator[None]:
    """Inside a `no_host_sync` region: a part checked elsewhere (e.g. the model forward, whose CPU
    MoE reference reads routing back) runs unguarded, so the guard checks the code around it."""
    global _allowed
    cuda = torch.cuda.is_available()
    _allowed += 1
    if cuda:
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("default")
    try:
        yield
    finally:
        _allowed -= 1
        if cuda:
            torch.cuda.set_sync_debug_mode(mode)


# What a CUDA graph cannot capture besides a sync: pinned host memory allocated inside the capture
# (cudaHostAlloc is illegal while a stream captures) and a tensor built from host data (an upload
# from pageable memory is illegal; were it legal, the graph would replay the captured value forever).
_PIN_FACTORIES = ("empty", "zeros", "ones", "full", "empty_like", "zeros_like")
_HOST_DATA = ("tensor", "as_tensor", "from_numpy")


def _wrap_capture(name: str, original, pinned_only: bool):
    def guarded(*args, **kwargs):
        caller = sys._getframe(1)
        if _ours(caller) and (not pinned_only or kwargs.get("pin_memory")):
            where = f"{caller.f_code.co_filename}:{caller.f_lineno}"
            what = "allocates pinned host memory" if pinned_only or name == "pin_memory" else "builds a tensor from host data"
            raise HostSyncError(f"torch.{name} {what} inside a CUDA-graph capture ({where})")
        return original(*args, **kwargs)

    return guarded


@contextlib.contextmanager
def capture_guard() -> Iterator[None]:
    """Inside: what a real capture would reject fails here too, on CPU -- a host sync (as in
    `no_host_sync`), pinned allocation, a tensor built from host data. The CPU stand-in of a CUDA
    graph (`EagerGraphBackend`) captures under it."""
    patched = {n: (torch, getattr(torch, n), _wrap_capture(n, getattr(torch, n), True)) for n in _PIN_FACTORIES}
    patched |= {n: (torch, getattr(torch, n), _wrap_capture(n, getattr(torch, n), False)) for n in _HOST_DATA}
    patched["pin_memory"] = (torch.Tensor, torch.Tensor.pin_memory,
                             _wrap_capture("pin_memory", torch.Tensor.pin_memory, False))
    with no_host_sync():
        try:
            for n, (owner, _, new) in patched.items():
                setattr(owner, n, new)
            yield
        finally:
            for n, (owner, old, _) in patched.items():
                setattr(owner, n, old)
