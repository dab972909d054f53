"""Forced drafts for speculative decoding tests and benchmarks (EAGLEWorker.draft_override).

Random weights accept (almost) nothing, so the accept path is exercised by proposing the target's
own next tokens, known from a plain run: every draft right, every draft wrong (each token + 1), or
"mixed" (wrong where (tokens generated + draft index) % 3 == 1: a run must stop at its first wrong
draft). Every mode must still give plain decoding's output.
"""

from __future__ import annotations

import torch

from sglang.srt.utils.common import upload

FORCED_MODES = ("right", "wrong", "mixed")


def forced_drafts(targets: dict[tuple[int, ...], list[int]], mode: str, vocab: int = 1000):
    """A draft_override: `targets` maps a prompt (token ids) to plain decoding's output ids.

    Device-resident, so a forced step keeps the overlap a natural one has (a host read of the KV
    lengths here would wait for the step in flight and expose every launch of the rest of the
    step: the benchmark would time the hook, not speculative decoding): the targets of a batch's
    requests are uploaded once per batch composition, each step gathers on the device."""
    if mode not in FORCED_MODES:
        raise ValueError(f"mode {mode!r} is not one of {FORCED_MODES}")
    cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(reqs, s: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (s, str(device)) + tuple(r.rid for r in reqs)  # rids: unique per request, cheap to hash
        if key not in cache:
            rows = [targets[tuple(r.origin_input_ids)] for r in reqs]
            width = max(len(t) for t in rows) + s + 1
            table = torch.tensor([t + [5] * (width - len(t)) for t in rows], dtype=torch.int64)
            plen = torch.tensor([len(r.origin_input_ids) for r in reqs], dtype=torch.int64)
            cache.clear()  # one composition at a time: a finished request changes it
            cache[key] = (upload(table, device), upload(plen, device))
        return cache[key]

    def override(reqs, drafts: torch.Tensor, kv_lens: torch.Tensor) -> torch.Tensor:
        """`kv_lens`: [b] device tensor, each request's committed KV length at this step (the
        host's output_ids lag behind a step in flight under overlap): the request has
        output[k - 1] as its last token, k = kv_len - prompt_len + 1."""
        s, dev = drafts.shape[1], drafts.device
        table, plen = tables(reqs, s, dev)
        k = kv_lens.to(torch.int64) - plen + 1  # tokens generated before this step
        at = k[:, None] + torch.arange(s, device=dev)[None, :]  # output index of each draft
        ahead = table.gather(1, at.clamp(0, table.shape[1] - 1))
        if mode == "right":
            return ahead
        if mode == "wrong":
            return (ahead + 1) % vocab
        return torch.where(at % 3 == 1, (ahead + 1) % vocab, ahead)  # mixed

    return override


# -- outputs equal "within the numerics" (the default mode on a GPU) ------------------------------------
# A verify row is plain decoding's row computed in another batch shape (b * n rows instead of b), and
# GPU GEMM libraries pick kernels by shape, so its logits differ from plain's by the same mechanism as
# a prompt decoded alone vs in a batch. The bound is that mechanism measured in the same run (plain
# alone vs plain batched: `batch_shape_noise`) times SAFETY, never below FLOOR_NATS; a logic bug (a
# wrong KV row, position or mask) moves logprobs by far more.
SAFETY = 4.0
FLOOR_NATS = 2.0 ** -10


def _token_logprobs(o: dict) -> list[float]:
    return [t[0] for t in o["meta_info"]["output_token_logprobs"]]


def batch_shape_noise(alone: list[dict], batched: list[dict]) -> float:
    """Largest |logprob difference| of the same greedy tokens decoded alone vs in a batch (up to the
    first token where they part)."""
    worst = 0.0
    for a, b in zip(alone, batched):
        for ta, tb, la, lb in zip(a["output_ids"], b["output_ids"], _token_logprobs(a), _token_logprobs(b)):
            worst = max(worst, abs(la - lb))
            if ta != tb:
                break
    return worst


def verify_tolerance(noise: float) -> float:
    return max(SAFETY * noise, FLOOR_NATS)


def within_tolerance_violation(ref: list[dict], got: list[dict], tol: float) -> str | None:
    """None when every output of `got` equals plain's `ref` within `tol`, else what breaks it. Both
    ran with return_logprob and top_logprobs_num >= 2. Up to the first differing token, each token's
    logprob is within `tol` of plain's; the first differing token and plain's pick must both be in
    plain's top-N (N = top_logprobs_num) within 2 * tol of its best logprob (each side may move by
    tol; in an exact tie the order is not plain's choice). Random weights give flat distributions,
    so a flip may land on the third or later candidate: ask for N > 2 to check those."""
    for i, (r, g) in enumerate(zip(ref, got)):
        rl, gl = _token_logprobs(r), _token_logprobs(g)
        for j, (rt, gt) in enumerate(zip(r["output_ids"], g["output_ids"])):
            if rt == gt:
                if abs(rl[j] - gl[j]) > tol:
                    return f"request {i} token {j}: logprob {gl[j]:.6f} vs plain {rl[j]:.6f} (tolerance {tol:.2e})"
                continue
            top = {t[1]: t[0] for t in r["meta_info"]["output_top_logprobs"][j]}
            best = max(top.values())
            if rt not in top or gt not in top or best - top[gt] > 2 * tol or best - top[rt] > 2 * tol:
                listed = ", ".join(f"{tid} ({lp:.6f})" for tid, lp in top.items())
                return (f"request {i} parts from plain at token {j}: {gt} where plain's top-{len(top)} are {listed}, "
                        f"plain picked {rt}; a numerics flip needs another of those within {2 * tol:.2e} of the best")
            break
        else:
            if len(r["output_ids"]) != len(g["output_ids"]):
                return f"request {i}: {len(g['output_ids'])} tokens vs plain's {len(r['output_ids'])}"
    return None
