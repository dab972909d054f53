"""What an L3 page's KV was computed by: the fingerprint that keys a server's pages in the store.

A page key (`page_hashes`) says which tokens the KV is of; it does not say which model computed it.
Two servers under one model name -- a checkpoint updated in place, two fine-tunes, another
`--json-model-override-args`, another dtype -- compute different KV for the same tokens, and one
must never load the other's (the fork's "garbage after reload" class). So every server's pages live
in a namespace that includes this fingerprint, and every page blob carries it: a blob of another
fingerprint is refused (StorageLayoutError), never loaded.

Inputs: the weights' identity (each weight file's name, size and mtime -- a rewrite changes its
mtime; hashing a 1.3 TB checkpoint at start-up is not affordable; `--load-format dummy` weights are
the fixed-seed random ones), or `kv_fingerprint` from the storage extra config where copies of one
checkpoint on several hosts must share a store (a revision string the operator vouches for); the
model config after overrides; the pool layout (dtypes, page size, index-K layers = the IndexCache
schedule); the quantisation; the TP and CP sizes (the rank is in the namespace).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

# Config keys that name or version a checkpoint without changing what it computes.
_VOLATILE_CONFIG_KEYS = frozenset({"_name_or_path", "name_or_path", "transformers_version", "_commit_hash",
                                   "_attn_implementation_autoset", "_attn_implementation_internal"})
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
FINGERPRINT_VERSION = 1


def weights_identity(model_path: str, load_format: str = "auto") -> list | str:
    """The weight files of a checkpoint directory as [name, size, mtime_ns] rows (sorted), the
    safetensors index included; "dummy" for random weights (drawn from a fixed seed)."""
    if load_format == "dummy":
        return "dummy"
    rows = []
    for root, _, files in os.walk(model_path):
        for name in files:
            if name.endswith(WEIGHT_SUFFIXES) or name.endswith(".safetensors.index.json"):
                path = os.path.join(root, name)
                st = os.stat(path)
                rows.append([os.path.relpath(path, model_path), st.st_size, st.st_mtime_ns])
    return sorted(rows)


def config_identity(hf_config: Any) -> dict:
    """The model config as a plain dict (overrides applied), without naming / version keys."""
    d = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    return {k: v for k, v in d.items() if k not in _VOLATILE_CONFIG_KEYS}


def kv_fingerprint(weights: list | str, config: dict, layout: dict, **settings: Any) -> str:
    """SHA-256 hex over the canonical JSON of everything that determines a pool's KV bytes."""
    doc = {"version": FINGERPRINT_VERSION, "weights": weights, "config": config, "layout": layout,
           "settings": settings}
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()
