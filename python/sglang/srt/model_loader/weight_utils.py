"""Checkpoint iteration helpers: find safetensors shards, stream tensors, undo FP8 block quantisation.

Name mapping onto model parameters is the model's job (``Model.load_weights``); everything here
works on HF checkpoint names and leaves dtype casting to the model's weight loaders.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import sys
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
SCALE_INV_SUFFIX = "_scale_inv"  # DeepSeek convention: "X.weight" is paired with "X.weight_scale_inv"
INPUT_SCALE_SUFFIX = ".input_scale"
DEFAULT_BLOCK_SIZE = (128, 128)
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448

# Any float8 storage dtype can be dequantised the same way (.float() * scale); only e4m3fn is produced.
_FP8_DTYPES = frozenset(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if hasattr(torch, n)
)

_MAX_LISTED = 20


def _fmt_names(names: Iterable[str], limit: int = _MAX_LISTED) -> str:
    names = sorted(names)
    shown = ", ".join(names[:limit])
    if len(names) > limit:
        shown += f", ... ({len(names) - limit} more)"
    return shown


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def find_weight_files(model_dir: str) -> list[str]:
    """Safetensors files of a checkpoint, in a deterministic order.

    Precedence: the shard index's ``weight_map`` (so stray extra files, e.g. consolidated copies,
    are ignored), then ``model.safetensors``, then every ``*.safetensors`` sorted by name.
    """
    if not os.path.isdir(model_dir):
        raise ValueError(f"model directory {model_dir!r} does not exist or is not a directory")

    index_path = os.path.join(model_dir, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            index = json.load(f)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path} has no (or an empty) 'weight_map'")
        files = [os.path.join(model_dir, s) for s in sorted(set(weight_map.values()))]
        missing = [p for p in files if not os.path.isfile(p)]
        if missing:
            raise ValueError(
                f"{index_path} references {len(missing)} shard(s) that do not exist: "
                f"{_fmt_names(os.path.basename(p) for p in missing)}"
            )
        return files

    single = os.path.join(model_dir, SAFETENSORS_SINGLE)
    if os.path.isfile(single):
        return [single]

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if files:
        return files

    others = sorted(
        os.path.basename(p)
        for pat in ("*.bin", "*.pt", "*.pth")
        for p in glob.glob(os.path.join(model_dir, pat))
    )
    hint = (
        f" Found non-safetensors weight files ({_fmt_names(others, 5)}); convert them to "
        "safetensors first." if others else ""
    )
    raise ValueError(
        f"no *.safetensors weight files found in {model_dir!r}; only the safetensors format is "
        f"supported.{hint}"
    )


def iter_safetensors_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, cpu_tensor)`` for every tensor of every checkpoint file.

    Tensors are read one at a time (memory-mapped by safetensors), so peak memory stays at
    roughly one tensor plus whatever the consumer keeps.
    """
    from safetensors import safe_open

    files = find_weight_files(model_dir)
    if len(files) > 1:
        from tqdm.auto import tqdm

        # Progress only on an interactive terminal: keeps logs and test output clean.
        files_iter: Iterable[str] = tqdm(
            files, desc="Loading safetensors shards", unit="file", disable=not sys.stderr.isatty()
        )
    else:
        files_iter = files
    for path in files_iter:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def checkpoint_tensor_names(model_dir: str) -> set[str]:
    """Names of every tensor in the checkpoint, from the shard index or the files' headers (no tensor
    data is read); empty when the directory has no safetensors files (config.json only: dummy weights)."""
    from safetensors import safe_open

    index_path = os.path.join(model_dir, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            return set(json.load(f).get("weight_map") or {})
    try:
        files = find_weight_files(model_dir)
    except ValueError:
        return set()
    names: set[str] = set()
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            names.update(f.keys())
    return names


# --------------------------------------------------------------------------------------------
# Quantisation config
# --------------------------------------------------------------------------------------------


def read_quant_config(model_dir: str) -> dict | None:
    """Return config.json's validated ``quantization_config`` or None for unquantised models.

    Only DeepSeek-style FP8 is supported: quant_method "fp8", fmt "e4m3" (absent is taken as
    e4m3, as HF transformers' FP8 config omits it), dynamic activation scaling, and a
    2-element ``weight_block_size`` (absent -> [128, 128]; filled into the returned copy).
    """
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        cfg = json.load(f)
    quant = cfg.get("quantization_config")
    if quant is None:
        return None
    supported = (
        "supported: quant_method 'fp8' with fmt 'e4m3', activation_scheme 'dynamic' and a "
        "2-element weight_block_size (DeepSeek-V3 style block FP8)"
    )
    if not isinstance(quant, dict):
        raise ValueError(f"{path}: quantization_config must be an object, got {quant!r}; {supported}")
    method = quant.get("quant_method")
    if method != "fp8":
        raise ValueError(f"{path}: unsupported quantization method {method!r}; {supported}")
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{path}: unsupported fp8 fmt {fmt!r} for quant_method 'fp8'; {supported}")
    act = quant.get("activation_scheme", "dynamic")
    if act != "dynamic":
        raise ValueError(
            f"{path}: unsupported activation_scheme {act!r} (static activation quantisation is "
            f"not supported); {supported}"
        )
    block = quant.get("weight_block_size", list(DEFAULT_BLOCK_SIZE))
    if (
        not isinstance(block, (list, tuple))
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(
            f"{path}: unsupported weight_block_size {block!r} for quant_method 'fp8' "
            f"(per-tensor / per-channel FP8 is not supported); {supported}"
        )
    out = dict(quant)
    out["fmt"] = fmt
    out["weight_block_size"] = [int(block[0]), int(block[1])]
    return out


# --------------------------------------------------------------------------------------------
# FP8 block (de)quantisation
# --------------------------------------------------------------------------------------------


def _check_block_size(block_size: tuple[int, int]) -> tuple[int, int]:
    if len(block_size) != 2 or any(int(b) <= 0 for b in block_size):
        raise ValueError(f"block_size must be two positive ints, got {block_size!r}")
    return int(block_size[0]), int(block_size[1])


def _blocked_view(x: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """[N, K] -> [nb, bn, kb, bk], zero-padding the ragged edge blocks."""
    n, k = x.shape
    nb, kb = math.ceil(n / bn), math.ceil(k / bk)
    pad_n, pad_k = nb * bn - n, kb * bk - k
    if pad_n or pad_k:
        x = F.pad(x, (0, pad_k, 0, pad_n))
    return x.reshape(nb, bn, kb, bk)


def block_dequant_fp8(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """``weight.float() * scale_inv`` broadcast over [bn, bk] blocks, cast to ``dtype``.

    ``weight`` is [N, K] float8, ``scale_inv`` is [ceil(N/bn), ceil(K/bk)]; edge blocks may be
    partial. Math is done in float32 so the only rounding is the final cast.
    """
    bn, bk = _check_block_size(block_size)
    if weight.dim() != 2:
        raise ValueError(f"block FP8 weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    expected = (math.ceil(n / bn), math.ceil(k / bk))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not match weight shape {(n, k)} with "
            f"block size {(bn, bk)}: expected {expected} (wrong weight_block_size in config?)"
        )
    w = _blocked_view(weight.float(), bn, bk)
    w = w * scale_inv.float()[:, None, :, None]
    return w.reshape(expected[0] * bn, expected[1] * bk)[:n, :k].to(dtype).contiguous()


def quantize_fp8_block(
    weight: torch.Tensor, block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`block_dequant_fp8`: ``(fp8_e4m3fn [N, K], scale_inv fp32 [nb, kb])``.

    scale_inv = amax(|block|) / 448 so each block's largest element maps to the e4m3 max.
    All-zero blocks get scale 1 (any positive value works; it avoids 0/0).
    """
    bn, bk = _check_block_size(block_size)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    w = _blocked_view(weight.float(), bn, bk)  # padding zeros never raise a block's amax
    amax = w.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (w / scale[:, None, :, None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = q.reshape(w.shape[0] * bn, w.shape[2] * bk)[:n, :k].contiguous().to(torch.float8_e4m3fn)
    return q, scale.contiguous()


def dequantize_fp8_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``weights``, replacing each FP8 ``X`` + ``X_scale_inv`` pair by dequantised ``X``.

    The two halves of a pair may come in either order and from different shards: whichever
    arrives first is buffered until its partner shows up. Checkpoints store them adjacently,
    so the buffer normally holds at most one tensor. ``*_scale_inv`` names are never yielded.
    Non-FP8 tensors pass through untouched (no dtype cast: the model's loaders do that).
    Unpaired leftovers raise one ValueError at the end of the stream.
    """
    block_size = _check_block_size(block_size)
    pending_weights: dict[str, torch.Tensor] = {}  # fp8 weight waiting for its scale
    pending_scales: dict[str, torch.Tensor] = {}  # scale waiting for its weight, keyed by weight name
    passed_through: set[str] = set()  # non-FP8 names already yielded, to flag a late scale for them
    per_tensor_scales: set[str] = set()  # "X.weight_scale" seen: hint in the final error
    max_pending = 0

    for name, tensor in weights:
        if name.endswith(INPUT_SCALE_SUFFIX):
            raise ValueError(
                f"checkpoint tensor {name!r} is a static activation scale; static activation "
                "quantisation is not supported (only block-FP8 weights with dynamic activation "
                "scaling, i.e. *.weight + *.weight_scale_inv)"
            )
        if name.endswith(SCALE_INV_SUFFIX):
            base = name[: -len(SCALE_INV_SUFFIX)]
            if base in passed_through:
                raise ValueError(f"got scale {name!r} for {base!r}, which is not an FP8 tensor")
            w = pending_weights.pop(base, None)
            if w is None:
                pending_scales[base] = tensor
            else:
                yield base, block_dequant_fp8(w, tensor, block_size, dtype)
        elif tensor.dtype in _FP8_DTYPES:
            s = pending_scales.pop(name, None)
            if s is None:
                pending_weights[name] = tensor
            else:
                yield name, block_dequant_fp8(tensor, s, block_size, dtype)
        else:
            if name in pending_scales:
                raise ValueError(
                    f"got scale {name + SCALE_INV_SUFFIX!r} for {name!r}, which is "
                    f"{tensor.dtype}, not an FP8 tensor"
                )
            if name.endswith(".weight_scale"):
                per_tensor_scales.add(name)
            passed_through.add(name)
            yield name, tensor
        n_pending = len(pending_weights) + len(pending_scales)
        if n_pending > max_pending:
            max_pending = n_pending

    if max_pending > 1:
        # Not an error, but the buffer grew: the checkpoint separates weights from their scales.
        logger.debug("FP8 dequant buffered up to %d unpaired tensors", max_pending)
    if pending_weights or pending_scales:
        parts = []
        if pending_weights:
            parts.append(
                f"{len(pending_weights)} FP8 weight(s) without a '{SCALE_INV_SUFFIX}' scale: "
                f"{_fmt_names(pending_weights)}"
            )
        if pending_scales:
            parts.append(
                f"{len(pending_scales)} scale(s) without an FP8 weight: "
                f"{_fmt_names(n + SCALE_INV_SUFFIX for n in pending_scales)}"
            )
        hint = ""
        if per_tensor_scales:
            hint = (
                f" (found per-tensor '*.weight_scale' tensors such as "
                f"{sorted(per_tensor_scales)[0]!r}; only block-wise '*.weight_scale_inv' is supported)"
            )
        raise ValueError("incomplete FP8 checkpoint: " + "; ".join(parts) + hint)


# --------------------------------------------------------------------------------------------
# Completeness check
# --------------------------------------------------------------------------------------------


def check_weights_complete(expected: set[str], loaded: set[str], unexpected: set[str]) -> None:
    """Raise one ValueError naming missing (expected - loaded) and unexpected weights, if any.

    Reporting everything at once beats failing on the first name when a mapping is off.
    """
    missing = set(expected) - set(loaded)
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(
            f"{len(missing)} missing weight(s) (of {len(expected)} expected): {_fmt_names(missing)}"
        )
    if unexpected:
        parts.append(
            f"{len(unexpected)} unexpected checkpoint weight(s): {_fmt_names(unexpected)}"
        )
    raise ValueError("checkpoint does not match the model: " + "; ".join(parts))
