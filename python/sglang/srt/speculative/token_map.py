"""FR-Spec hot-token drafting (`--speculative-token-map`, upstream's flag): the draft's lm_head
projects onto a subset of the vocabulary only (the tokens a frequency ranking calls hot), so a
draft step's 129K-row head becomes a K-row one; a draft is the hot token of highest logit, mapped
back to its vocabulary id. Output is unchanged -- the target verifies every draft and each
produced token is the target's own pick -- only the acceptance rate can drop where the target's
choice is not hot.

File formats: a torch file (`.pt`, a 1-D tensor or list of token ids, as upstream's
`load_token_map`), `.json` (a list of ids) or text (ids separated by whitespace or commas).
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from sglang.srt.layers import batch_invariant
from sglang.srt.errors import ServerArgsError

FLAG = "speculative_token_map"


def _read_ids(path: str) -> list:
    if path.endswith((".pt", ".pth")):
        obj = torch.load(path, map_location="cpu", weights_only=True)
        return obj.tolist() if isinstance(obj, torch.Tensor) else list(obj)
    with open(path) as f:
        text = f.read()
    if path.endswith(".json"):
        return list(json.loads(text))
    return [tok for tok in text.replace(",", " ").split()]


def load_token_map(path: str, vocab_size: int) -> torch.Tensor:
    """The hot token ids of `path` (int64, in the file's order): each an id of the vocabulary,
    no repeats, at least one. Anything else is a start-up error naming the flag."""
    if not os.path.isfile(path):
        raise ServerArgsError(FLAG, f"no such file: {path}")
    try:
        raw = _read_ids(path)
        ids = torch.tensor([int(x) for x in raw], dtype=torch.int64)
    except Exception as e:  # (any parse failure: the file is the user's)
        raise ServerArgsError(FLAG, f"could not read token ids from {path}: {e}") from e
    if ids.ndim != 1 or ids.numel() == 0:
        raise ServerArgsError(FLAG, f"{path} holds no token ids")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.numel():
        raise ServerArgsError(FLAG, f"{path}: token id {int(bad[0])} is outside the vocabulary "
                              f"[0, {vocab_size})")
    if torch.unique(ids).numel() != ids.numel():
        raise ServerArgsError(FLAG, f"{path} repeats token ids")
    return ids


class HotTokenHead(nn.Module):
    """The draft's lm_head restricted to the hot rows, replicated on every TP rank (K rows; no
    all-gather of logits): `logits(h)` is [rows, K] over the hot ids in map order."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.num_embeddings = weight.shape[0]

    @classmethod
    def from_lm_head(cls, lm_head: nn.Module, hot_ids: torch.Tensor) -> "HotTokenHead":
        """Gathers the hot rows of a (vocab-sharded) ParallelLMHead: each rank fills the rows its
        shard holds, zeros elsewhere, and one all-reduce replicates them."""
        w, start = lm_head.weight, lm_head.start
        ids = hot_ids.to(w.device)
        local = (ids >= start) & (ids < lm_head.end)
        hot = torch.zeros(ids.numel(), w.shape[1], dtype=w.dtype, device=w.device)
        hot[local] = w[ids[local] - start]
        if not lm_head.tp_group.is_single:
            hot = lm_head.tp_group.all_reduce(hot)
        return cls(hot)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return batch_invariant.linear(hidden, self.weight)


def draft_token_ids(logits: torch.Tensor, hot_ids: torch.Tensor | None) -> torch.Tensor:
    """The draft's greedy token per row: its argmax, mapped back through the hot ids if any."""
    top = logits.argmax(dim=-1)
    return top if hot_ids is None else hot_ids[top]
