"""Per-device tuned config tables of the FP8 kernels (upstream SGLang's idea: one JSON per device).

    sgl_kernel/configs/fp8_gemm_<device>.json   {"configs": {"N=2112,K=7168": {"1": {...}, "64": {...}}}}
    sgl_kernel/configs/fp8_moe_<device>.json    {"configs": {"E=256,H=7168,I=2048,k=8": {"1": {...}}}}

<device> is torch.cuda.get_device_name() with spaces as underscores (NVIDIA_H100_80GB_HBM3); under the
Triton interpreter it is "cpu" (the tuner's --smoke tables). benchmark/kernels/tune_fp8.py writes
them; a run reads the directory in $SGL_KERNEL_FP8_CONFIG_DIR first (a fresh tuner output), then the
shipped one. A (shape, M) lookup takes the bucket nearest to M in log scale; no table or no entry for
the shape -> None, and the kernel uses its heuristic. --enable-deterministic-inference never reads a
table (the kernels' fixed configs). Tables are read once per process (host-side, outside any graph).
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
CONFIG_DIR_ENV = "SGL_KERNEL_FP8_CONFIG_DIR"


@functools.lru_cache(maxsize=16)
def device_name(device: torch.device | str | None = None) -> str:
    """The table's device key: the CUDA device's name, or "cpu" under the interpreter / on CPU."""
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev).replace(" ", "_")
    return "cpu"


def table_file(kind: str, device: str) -> str:
    return f"{kind}_{device}.json"


def _dirs() -> list[Path]:
    env = os.environ.get(CONFIG_DIR_ENV)
    return ([Path(env)] if env else []) + [CONFIG_DIR]


@functools.lru_cache(maxsize=32)
def load_table(kind: str, device: str, dirs: tuple[Path, ...]) -> dict | None:
    for d in dirs:
        path = d / table_file(kind, device)
        if path.is_file():
            data = json.loads(path.read_text())
            if not isinstance(data.get("configs"), dict):
                raise ValueError(f"{path}: no 'configs' mapping (written by benchmark/kernels/tune_fp8.py?)")
            return data["configs"]
    return None


def nearest_bucket(buckets: list[int], m: int) -> int:
    """The bucket nearest to m in log scale (M 2000 -> 2048-ish buckets, never 1)."""
    return min(buckets, key=lambda b: (abs(math.log2(max(b, 1)) - math.log2(max(m, 1))), b))


def lookup(kind: str, device: torch.device | str, shape_key: str, m: int) -> dict | None:
    """The tuned fields for (shape, M) on this device, or None (use the heuristic)."""
    return _lookup(kind, device_name(device), shape_key, m, tuple(_dirs()))


@functools.lru_cache(maxsize=4096)  # a prefill calls this per linear layer: keep it a dict hit
def _lookup(kind: str, device: str, shape_key: str, m: int, dirs: tuple[Path, ...]) -> dict | None:
    table = load_table(kind, device, dirs)
    if not table or shape_key not in table:
        return None
    by_m = table[shape_key]
    return dict(by_m[str(nearest_bucket([int(b) for b in by_m], m))])


def clear_cache() -> None:
    """Forget loaded tables (the tuner and tests write new ones in-process)."""
    load_table.cache_clear()
    _lookup.cache_clear()
