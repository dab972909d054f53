"""Small helpers shared across the runtime (device/dtype resolution, logging)."""

from __future__ import annotations

import logging
import os

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def str_to_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.lower()]
    except KeyError as e:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(set(_DTYPES))}") from e


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def get_bool_env(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def configure_logger(level: str = "info", prefix: str = "") -> None:
    fmt = f"[%(asctime)s{prefix}] %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=getattr(logging, level.upper()), format=fmt, datefmt="%H:%M:%S", force=True)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def upload(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """One host->device copy that never makes the host wait: from pinned memory, non_blocking, on
    the current stream (whose later kernels are ordered after it). A pageable `.to(device)` waits
    for the copy, i.e. for every kernel queued before it -- under overlap, the step in flight.
    A no-op on CPU."""
    dev = torch.device(device)
    if dev.type != "cuda" or host.device.type != "cpu":
        return host.to(dev)
    return host.pin_memory().to(dev, non_blocking=True)


def to_host_async(t: torch.Tensor) -> torch.Tensor:
    """Queue a device->host copy into pinned memory (a no-op on CPU): `upload`'s other direction.
    Read it only after an event recorded behind the copy (copies_done_event) has completed."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def copies_done_event(t: torch.Tensor) -> "torch.cuda.Event | None":
    """An event recorded after the copies queued so far (None on CPU, where they are done):
    `to_host()` of a launched step waits on it, never on the whole device."""
    if t.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event
