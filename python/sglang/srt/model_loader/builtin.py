"""``builtin:NAME`` model paths: tiny checkpoints materialised locally on first use.

Nothing is ever downloaded. ``resolve_model_path("builtin:tiny-glm-moe-dsa")``
builds the checkpoint with :mod:`sglang.srt.model_loader.tiny_models` into
``$SGLANG_BUILTIN_CACHE/NAME-<hash>`` (default ``~/.cache/sglang/builtin``) and
returns that directory; later calls (and other processes) reuse it. The hash
covers the spec, the generator's source and the transformers version, so a code
change never serves a stale checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

BUILTIN_PREFIX = "builtin:"
CACHE_ENV = "SGLANG_BUILTIN_CACHE"
DEFAULT_CACHE_DIR = "~/.cache/sglang/builtin"
# Written last inside the build dir; a directory without it is never served.
_MARKER = ".sglang_builtin.json"
_TINY_MODELS_SOURCES = [Path(__file__).resolve().parent / f for f in ("tiny_models.py", "tiny_tokenizer.py")]
_FP8_WRITER_SOURCE = Path(__file__).resolve().parent / "fp8_checkpoint.py"


@dataclass(frozen=True)
class BuiltinSpec:
    """Arguments for :func:`sglang.srt.model_loader.tiny_models.make_tiny_checkpoint`."""

    arch: str
    overrides: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    dtype: str = "float32"
    description: str = ""
    mtp_layer: bool = False
    fp8_block_size: tuple[int, int] | None = None  # saved in DeepSeek's block-FP8 format


# FP8 builtins: the real 128 x 128 block, dims chosen so that every TP 2 shard and fused-part boundary
# falls on a block edge (as in V3.2 / GLM-5) while kv_a_proj_with_mqa (64 + 16 = 80 rows, like the real
# 576) and the indexer's wk (64 rows) end in partial blocks; hidden 256 gives two K blocks per row.
_FP8_DIMS: dict[str, Any] = dict(
    hidden_size=256, intermediate_size=256, moe_intermediate_size=256, q_lora_rank=128,
    num_attention_heads=16, num_key_value_heads=16,
)
_FP8_BLOCK = (128, 128)


BUILTIN_MODELS: dict[str, BuiltinSpec] = {
    "tiny-deepseek-v32": BuiltinSpec(
        arch="deepseek_v32", description="DeepseekV32ForCausalLM, 4 layers, DSA index_topk=32, yarn rope"
    ),
    "tiny-glm-moe-dsa": BuiltinSpec(
        arch="glm_moe_dsa", description="GlmMoeDsaForCausalLM, 4 layers, every layer runs the indexer"
    ),
    "tiny-glm-moe-dsa-shared": BuiltinSpec(
        arch="glm_moe_dsa",
        overrides={"num_hidden_layers": 6, "index_topk_freq": 2, "index_skip_topk_offset": 2},
        description="GlmMoeDsaForCausalLM, 6 layers, indexer_types F F S F S F (shared top-k)",
    ),
    "tiny-deepseek-v3": BuiltinSpec(
        arch="deepseek_v3", description="DeepseekV3ForCausalLM (dense MLA, no indexer), 4 layers"
    ),
    "tiny-deepseek-v32-mtp": BuiltinSpec(
        arch="deepseek_v32", mtp_layer=True,
        description="tiny-deepseek-v32 plus a NextN/MTP draft layer (--speculative-algorithm EAGLE / NEXTN)"
    ),
    "tiny-glm-moe-dsa-mtp": BuiltinSpec(
        arch="glm_moe_dsa", mtp_layer=True, overrides={"index_topk_freq": 2, "index_skip_topk_offset": 2},
        description="GlmMoeDsaForCausalLM with shared top-k layers and a NextN/MTP draft layer"
    ),
    "tiny-deepseek-v32-fp8": BuiltinSpec(
        arch="deepseek_v32", dtype="bfloat16", overrides=_FP8_DIMS, fp8_block_size=_FP8_BLOCK,
        description="DeepseekV32ForCausalLM in DeepSeek's block-FP8 format (e4m3 [128, 128] blocks, bf16 rest)"
    ),
    "tiny-glm-moe-dsa-fp8": BuiltinSpec(
        arch="glm_moe_dsa", dtype="bfloat16", overrides=_FP8_DIMS, fp8_block_size=_FP8_BLOCK,
        description="GlmMoeDsaForCausalLM in the block-FP8 format of zai-org/GLM-5-FP8"
    ),
    "tiny-deepseek-v32-fp8-mtp": BuiltinSpec(
        arch="deepseek_v32", dtype="bfloat16", overrides=_FP8_DIMS, fp8_block_size=_FP8_BLOCK, mtp_layer=True,
        description="tiny-deepseek-v32-fp8 plus an FP8 NextN/MTP draft layer"
    ),
    "tiny-deepseek-v32-bf16": BuiltinSpec(
        arch="deepseek_v32", dtype="bfloat16", description="tiny-deepseek-v32 weights saved in bfloat16"
    ),
}


def is_builtin(model_path: str) -> bool:
    return isinstance(model_path, str) and model_path.startswith(BUILTIN_PREFIX)


def builtin_cache_dir() -> Path:
    return Path(os.path.expanduser(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR))


def _available() -> str:
    return ", ".join(BUILTIN_PREFIX + name for name in BUILTIN_MODELS)


def get_builtin_spec(name: str) -> BuiltinSpec:
    if name not in BUILTIN_MODELS:
        raise ValueError(f"Unknown builtin model {name!r}. Available builtin models: {_available()}")
    return BUILTIN_MODELS[name]


def builtin_key(name: str) -> str:
    """Cache directory name: ``NAME-<short hash of spec + generator code version>``."""
    spec = get_builtin_spec(name)
    h = hashlib.sha256()
    h.update(json.dumps(asdict(spec), sort_keys=True, default=str).encode())
    for source in _TINY_MODELS_SOURCES:  # any generator change -> new dir
        h.update(source.read_bytes())
    if spec.fp8_block_size is not None:
        h.update(_FP8_WRITER_SOURCE.read_bytes())
    # config.json contents come from transformers' config classes.
    h.update(metadata.version("transformers").encode())
    return f"{name}-{h.hexdigest()[:12]}"


def _is_complete(path: Path) -> bool:
    return (path / _MARKER).is_file()


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    # Materialising is purely local; make any accidental hub access fail fast.
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: "1" for k in keys})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Serialise builders across processes; without fcntl the rename trick alone suffices."""
    try:
        import fcntl
    except ImportError:  # non-POSIX
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def materialize_builtin(name: str) -> str:
    """Return the cached checkpoint dir for builtin ``name``, building it if needed."""
    spec = get_builtin_spec(name)
    cache = builtin_cache_dir()
    final = cache / builtin_key(name)
    if _is_complete(final):
        return str(final)

    cache.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache / f".{final.name}.lock"):
        if _is_complete(final):  # another process built it while we waited
            return str(final)
        # Build next to the destination (same filesystem) so os.rename is atomic.
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache))
        try:
            from sglang.srt.model_loader.tiny_models import make_tiny_checkpoint

            with _offline():
                make_tiny_checkpoint(
                    str(tmp), arch=spec.arch, seed=spec.seed, dtype=spec.dtype, mtp_layer=spec.mtp_layer,
                    fp8_block_size=spec.fp8_block_size, **spec.overrides
                )
            # mkdtemp / safetensors create 0700 / 0600; the cache may be shared.
            tmp.chmod(0o755)
            for f in tmp.iterdir():
                f.chmod(0o644)
            (tmp / _MARKER).write_text(json.dumps({"name": name, **asdict(spec)}, indent=2, default=str))
            if final.exists() and not _is_complete(final):
                shutil.rmtree(final, ignore_errors=True)  # leftover of a broken manual copy
            try:
                os.rename(tmp, final)
            except OSError:
                if not _is_complete(final):  # lost the race only counts if the winner is valid
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


class ModelPathNotFoundError(ValueError, FileNotFoundError):
    """A local model path that does not exist (catchable as ValueError or FileNotFoundError)."""


def resolve_model_path(model_path: str) -> str:
    """Map ``builtin:NAME`` to its local checkpoint dir; return other paths unchanged.

    Raises ValueError for an unknown builtin name, and :class:`ModelPathNotFoundError`
    for a path that does not exist locally (there is no hub download).
    """
    if is_builtin(model_path):
        return materialize_builtin(model_path[len(BUILTIN_PREFIX) :])
    if not os.path.exists(os.path.expanduser(model_path)):
        raise ModelPathNotFoundError(
            f"Model path {model_path!r} does not exist. Downloading models is not supported: "
            f"pass a local checkpoint directory or a builtin model ({_available()})."
        )
    return model_path
