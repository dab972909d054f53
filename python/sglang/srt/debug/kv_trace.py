"""KV trace: hashes of KV pages across a HiCache round trip and of per-layer forward tensors.

Switched by `SGLANG_CP_HICACHE_KV_TRACE` (read once, when a tracer is asked for at construction):
- 1: main KV pages hashed at backup and at reload, keyed by host-slot fingerprint + layer;
- 2: plus the indexer K-with-scale pages at backup and after the indexer load;
- 3: plus per-layer forward hashes (attention input, top-k indices, attention output before the
  residual, MoE input) on the eager extend path only, never under CUDA-graph capture.
Unset or 0: `get_kv_tracer()` is None and callers hold no trace code on their hot path. Level 3's
forward records come from forward hooks (debug/hooks.py `install_kv_trace`), never from the model.

Records go as JSON lines to `SGLANG_KV_TRACE_PATH` (default `<tmp>/sglang_kv_trace.<pid>.jsonl`;
"{pid}" in the path is replaced, so ranks of one server write separate files). Every record
carries a run label (`SGLANG_KV_TRACE_RUN`, default "pid<pid>"; `KVTracer.set_run` changes it):
the analyzer (`python -m sglang.srt.debug.kv_trace_analyze`) compares forward hashes of one run
against a reference run, and reload hashes against backup hashes.

Hashes are blake2b (8 bytes) of the tensor's host bytes, so they do not depend on the device.

Forward keys: a request's extend rows are cut into blocks aligned to absolute positions
(`SGLANG_KV_TRACE_BLOCK` tokens, default 16); a block's key is a hash of its token ids plus its
position range. A fresh prefill of [0, L) and a reload extend of [P, L) thus share the keys of
every block after P when P is block-aligned (HiCache prefixes are page-aligned).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import torch

ENV_LEVEL = "SGLANG_CP_HICACHE_KV_TRACE"
ENV_PATH = "SGLANG_KV_TRACE_PATH"
ENV_RUN = "SGLANG_KV_TRACE_RUN"
ENV_BLOCK = "SGLANG_KV_TRACE_BLOCK"

PAGE_EVENTS = ("backup", "reload", "index_backup", "index_load")
PAYLOADS = ("kv", "index_k")
# Forward stages in the order they happen inside a decoder layer (the analyzer relies on it).
FORWARD_STAGES = ("attn_in", "topk", "attn_out", "moe_in")


def hash_bytes(t: torch.Tensor) -> str:
    """blake2b-64 of a tensor's host bytes (any dtype, any device)."""
    b = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(b, digest_size=8).hexdigest()


def degenerate_flags(t: torch.Tensor) -> list[str]:
    """What makes a hidden-state / top-k block suspicious: non-finite values, all zero, a row of
    zeros, all values equal; for top-k (integers), a row that selects nothing (all -1)."""
    if t.numel() == 0:
        return []
    rows = t.reshape(t.shape[0], -1) if t.dim() > 1 else t.reshape(1, -1)
    if not t.is_floating_point():
        return ["empty_selection"] if bool((rows < 0).all(dim=1).any()) else []
    flags = []
    x = rows.float()
    if not bool(torch.isfinite(x).all()):
        flags.append("nonfinite")
    zero_rows = (x == 0).all(dim=1)
    if bool(zero_rows.all()):
        flags.append("all_zero")
    elif bool(zero_rows.any()):
        flags.append("zero_rows")
    elif x.numel() > 1 and bool((x == x.reshape(-1)[0]).all()):
        flags.append("constant")
    return flags


@dataclass
class _Block:
    key: str
    rows: torch.Tensor  # host row indices into the forward's [T, ...] tensors


class KVTracer:
    """Thread-safe JSONL writer of trace records. The HiCache controller calls `record_pages`
    from its own thread; the model calls `begin_forward` / `record_forward_rows`."""

    def __init__(self, level: int, path: str, run: str | None = None, block: int = 16) -> None:
        if level not in (1, 2, 3):
            raise ValueError(f"{ENV_LEVEL} must be 0..3, got {level}")
        if block < 1:
            raise ValueError(f"{ENV_BLOCK} must be >= 1, got {block}")
        self.level, self.path, self.block = level, path, block
        self.run = run or f"pid{os.getpid()}"
        self._lock = threading.Lock()
        self._seq = 0
        self._forward_no = 0
        self._blocks: list[_Block] | None = None  # the current eager extend's row plan
        os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        self._f = open(path, "a", buffering=1 << 16)
        self._write({"ev": "meta", "level": level, "pid": os.getpid(), "block": block, "time": time.time()})
        atexit.register(self.close)

    # -- output -----------------------------------------------------------------------------------
    def _write(self, rec: dict) -> None:
        self._write_many([rec])

    def _write_many(self, recs: list[dict]) -> None:
        """One write under the lock: records of concurrent callers never interleave mid-line."""
        with self._lock:
            if self._f is None or not recs:
                return
            lines = []
            for rec in recs:
                self._seq += 1
                lines.append(json.dumps({"run": self.run, "seq": self._seq, **rec}, separators=(",", ":")))
            self._f.write("\n".join(lines) + "\n")

    def flush(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.flush()

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None

    @property
    def closed(self) -> bool:
        return self._f is None

    def set_run(self, label: str) -> None:
        """Label the records that follow (e.g. "fresh", "reload"): the analyzer compares runs."""
        with self._lock:
            self.run = label

    # -- pages (HiCache controller) ---------------------------------------------------------------
    def record_pages(self, event: str, fingerprint: str | Sequence[str], layer_id: int, payload: str,
                     data: torch.Tensor) -> None:
        """Hash each page row of `data` ([n_pages, ...], one row per page) for a backup / reload.

        `fingerprint` identifies the host slot of each page: a list (one per page), or one str
        (used as is for a single page, suffixed "#i" per row otherwise). Pass per-page lists so
        a backup and a reload chunked differently still match. Index-K events/payloads are
        recorded from level 2 on; at level 1 the call returns at once, so callers need no check.
        Reads `data` with a blocking `.cpu()`: on a side stream, call it once the copy is done."""
        if event not in PAGE_EVENTS:
            raise ValueError(f"event {event!r} not in {PAGE_EVENTS}")
        if payload not in PAYLOADS:
            raise ValueError(f"payload {payload!r} not in {PAYLOADS}")
        if self.level < 2 and (payload == "index_k" or event.startswith("index_")):
            return
        n = int(data.shape[0])
        if isinstance(fingerprint, str):
            fps = [fingerprint] if n == 1 else [f"{fingerprint}#{i}" for i in range(n)]
        else:
            fps = [str(f) for f in fingerprint]
            if len(fps) != n:
                raise ValueError(f"{len(fps)} fingerprints for {n} pages")
        host = data.detach().cpu().contiguous()
        raw = host.reshape(n, -1).view(torch.uint8)
        nz = (raw != 0).sum(dim=1).tolist()  # a page restored as zeros shows nz=0
        recs = [{"ev": event, "fp": fps[i], "layer": int(layer_id), "payload": payload,
                 "hash": hashlib.blake2b(raw[i].numpy().tobytes(), digest_size=8).hexdigest(), "nz": nz[i]}
                for i in range(n)]
        self._write_many(recs)

    def record_page_payloads(self, direction: str, fingerprint: str | Sequence[str], layer_id: int,
                             payloads: Sequence, pages: torch.Tensor) -> None:
        """Record rows `pages` of each of a layer's page payloads (`pool.page_payloads(layer_id)`):
        direction "backup" or "reload"; payload "kv" is recorded as that event, "index_k" as
        "index_backup" / "index_load". Hashes equal those of `record_pages` on get_kv_pages /
        get_index_k_pages (same bytes)."""
        if direction not in ("backup", "reload"):
            raise ValueError(f"direction {direction!r} not in ('backup', 'reload')")
        for p in payloads:
            event = direction if p.name == "kv" else ("index_backup" if direction == "backup" else "index_load")
            self.record_pages(event, fingerprint, layer_id, p.name, p.buffer[pages])

    # -- forward (model, level 3) -----------------------------------------------------------------
    def record_forward(self, stage: str, layer_id: int, key: str, tensor: torch.Tensor) -> None:
        """One forward record for a whole tensor under a caller-chosen key."""
        if self.level < 3:
            return
        self._write({"ev": "fwd", "fwd": self._forward_no, "stage": stage, "layer": int(layer_id), "key": key,
                     "rows": int(tensor.shape[0]) if tensor.dim() else 1, "hash": hash_bytes(tensor),
                     "flags": degenerate_flags(tensor.detach().cpu())})

    def begin_forward(self, forward_batch) -> bool:
        """Plan the per-request position blocks of an eager extend; False (and nothing recorded
        until the next begin) for decode, idle, level < 3 or inside a CUDA-graph capture."""
        self._blocks = None
        if self.level < 3 or not forward_batch.forward_mode.is_extend() or forward_batch.num_tokens == 0:
            return False
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return False
        self._forward_no += 1
        self._blocks = _plan_blocks(forward_batch, self.block)
        return True

    def end_forward(self) -> None:
        self._blocks = None

    def record_forward_rows(self, stage: str, layer_id: int, tensor: torch.Tensor | None) -> None:
        """Hash `tensor`'s rows ([T, ...], one per token of the current extend) block by block."""
        if self._blocks is None or tensor is None:
            return
        host = tensor.detach().cpu()
        recs = []
        for b in self._blocks:
            part = host.index_select(0, b.rows)
            recs.append({"ev": "fwd", "fwd": self._forward_no, "stage": stage, "layer": int(layer_id),
                         "key": b.key, "rows": int(b.rows.numel()), "hash": hash_bytes(part),
                         "flags": degenerate_flags(part)})
        self._write_many(recs)


def _host(fb, name: str) -> torch.Tensor:
    rows = fb.host_rows or {}
    t = rows.get(name)
    return (t if t is not None else getattr(fb, name)).detach().cpu().to(torch.int64)


def _plan_blocks(fb, block: int) -> list[_Block]:
    """Rows of each request, grouped by absolute position // block; CP dummy rows left out."""
    ids = _host(fb, "input_ids")
    pos = torch.tensor(fb.positions_cpu, dtype=torch.int64) if fb.positions_cpu is not None else _host(fb, "positions")
    if fb.token_to_req is not None or (fb.host_rows and "token_to_req" in fb.host_rows):
        req = _host(fb, "token_to_req")
    else:
        req = torch.repeat_interleave(torch.arange(fb.batch_size), torch.tensor(fb.extend_seq_lens_cpu))
    valid = torch.arange(ids.numel())
    cp = fb.cp.metadata
    if cp is not None:
        valid = cp.valid_idx.detach().cpu().to(torch.int64)
    out = []
    for r in torch.unique(req[valid]).tolist():
        rows = valid[req[valid] == r]
        rows = rows[torch.argsort(pos[rows], stable=True)]
        bid = pos[rows] // block
        for b in torch.unique(bid).tolist():
            sel = rows[bid == b]
            p = pos[sel]
            tok = hashlib.blake2b(ids[sel].numpy().tobytes(), digest_size=8).hexdigest()
            out.append(_Block(f"{tok}@{int(p[0])}-{int(p[-1]) + 1}", sel))
    return out


# One tracer per configuration, kept open: a model built under one environment keeps writing
# even if a later caller (a test) sees another; each flushes on close / at exit.
_TRACERS: dict[tuple, KVTracer] = {}
_TRACER_LOCK = threading.Lock()


def _config_from_env() -> tuple[int, str, str | None, int]:
    raw = os.environ.get(ENV_LEVEL, "").strip()
    try:
        level = int(raw) if raw else 0
    except ValueError:
        raise ValueError(f"{ENV_LEVEL} must be an integer 0..3, got {raw!r}") from None
    if not 0 <= level <= 3:
        raise ValueError(f"{ENV_LEVEL} must be 0..3, got {level}")
    path = os.environ.get(ENV_PATH) or os.path.join(tempfile.gettempdir(), "sglang_kv_trace.{pid}.jsonl")
    block_raw = os.environ.get(ENV_BLOCK, "16")
    try:
        block = int(block_raw)
    except ValueError:
        raise ValueError(f"{ENV_BLOCK} must be an integer, got {block_raw!r}") from None
    return level, path.replace("{pid}", str(os.getpid())), os.environ.get(ENV_RUN) or None, block


def get_kv_tracer(min_level: int = 1) -> KVTracer | None:
    """The process's tracer, or None when `SGLANG_CP_HICACHE_KV_TRACE` is unset / 0 / below
    `min_level`. Call it once at construction and keep the result: callers then guard with
    `if tracer is not None`, so nothing runs per token when tracing is off."""
    cfg = _config_from_env()
    if cfg[0] < max(min_level, 1):
        return None
    with _TRACER_LOCK:
        tracer = _TRACERS.get(cfg)
        if tracer is None or tracer.closed:
            tracer = _TRACERS[cfg] = KVTracer(*cfg)
    return tracer


class HiCacheTrace:
    """The HiCache controller's `trace` (levels 1-2): its per-page `record(event, fingerprint, layer,
    payload, tensor)` with event "backup" | "load" becomes a page record -- "backup" / "reload" for
    main KV, "index_backup" / "index_load" for index K (dropped below level 2 by the tracer).
    Fingerprint (host page, prefix-hash key) -> "hostpage:key", so a slot reused for other tokens
    is another fingerprint."""

    EVENTS = {("backup", "kv"): "backup", ("load", "kv"): "reload",
              ("backup", "index_k"): "index_backup", ("load", "index_k"): "index_load"}

    def __init__(self, tracer: KVTracer) -> None:
        self.tracer = tracer

    def record(self, event: str, fingerprint: tuple[int, str | None], layer_id: int, payload: str,
               tensor: torch.Tensor) -> None:
        page, key = fingerprint
        self.tracer.record_pages(self.EVENTS[(event, payload)], f"{page}:{key}", layer_id, payload,
                                 tensor.reshape(1, -1))


def hicache_trace() -> HiCacheTrace | None:
    """The controller's trace object, or None when `SGLANG_CP_HICACHE_KV_TRACE` is off."""
    tracer = get_kv_tracer()
    return None if tracer is None else HiCacheTrace(tracer)
