"""The PD benchmarks' client: one streamed /generate with the time of every token event."""

from __future__ import annotations

import json
import threading
import time

import requests


def stream(base_url: str, ids: list[int], max_new: int, t0: float, first: threading.Event | None = None,
           stop: threading.Event | None = None) -> dict:
    """One streamed /generate: send time, (time, tokens) per event (times relative to t0); `first` is
    set at the first token; `stop` ends it early (the client goes away: the server aborts it)."""
    sent = time.perf_counter() - t0
    events, n = [], 0
    with requests.post(base_url + "/generate", json={"input_ids": ids, "stream": True, "sampling_params": {
            "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}, stream=True, timeout=1200) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(ev["error"])
            k = ev["meta_info"]["completion_tokens"]
            if k > n:
                events.append((time.perf_counter() - t0, k - n))
                n = k
                if first is not None:
                    first.set()
            if stop is not None and stop.is_set():
                break
    return {"sent": sent, "events": events, "tokens": n}
