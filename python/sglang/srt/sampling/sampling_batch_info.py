"""SamplingBatchInfo: the per-batch tensors the Sampler reads, built from each request's params.

Build one per forward with `from_params(...)` (or build once and call
`cumulate_output_tokens(next_ids)` after every decode step to avoid rebuilding the [B, V]
counts from Python lists).

Semantics (documented choices):
- Greedy: temperature < SAMPLING_EPS or top_k == 1. Such rows get temperature 1 / top_k 1 here and
  the Sampler returns the argmax of the (penalised) logits for them.
- top-k / top-p / min-p are evaluated "jointly" on the full temperature-scaled softmax, as
  upstream SGLang's torch fallback and flashinfer's filter_apply_order="joint" do: a token is kept
  iff it is in the top-k set AND in the top-p nucleus AND has prob >= min_p * max_prob.
- Frequency / presence penalties count generated (output) tokens only (OpenAI semantics, as
  upstream). Repetition penalty also uses output tokens only, as current upstream SGLang does;
  pass `prompt_ids` to from_params to include the prompt (HF / vLLM semantics).
- Penalties, then the grammar vocab mask, then logit_bias, then the min_new_tokens EOS ban (last,
  so no bias can undo it): upstream's order for the first three. Custom logit processors run after
  all of these, in the Sampler (upstream's order too).
- Grammar mask: `update_regex_vocab_mask()` fills one packed int32 bitmask [B, ceil(V/32)] on the
  host from each constrained request's matcher (other rows allow everything) and uploads it once,
  non_blocking. Call it after the grammars accepted the previous step's tokens (from_params does).
- Seeded rows: one uniform per row from a counter-based hash of (sampling_seed, step), where step
  = tokens already generated; it depends on nothing else (batch, position, device, global RNG).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from sglang.srt.sampling.sampling_params import MASK64, SAMPLING_EPS, SamplingParams, splitmix64
from sglang.srt.utils.common import upload

def seeded_uniform(seed: int, step: int) -> float:
    """Uniform in [0, 1) from (seed, step). 24 bits, so it is exact in float32 and never 1.0."""
    h = splitmix64(splitmix64(seed & MASK64) ^ (step & MASK64))
    return (h >> 40) / float(1 << 24)


@dataclass
class SamplingBatchInfo:
    vocab_size: int
    device: torch.device | str
    temperatures: torch.Tensor  # [B, 1] fp32 (1.0 for greedy rows, so dividing is harmless)
    top_ps: torch.Tensor  # [B] fp32
    top_ks: torch.Tensor  # [B] int64, in [1, vocab_size] (-1 -> vocab_size)
    min_ps: torch.Tensor  # [B] fp32
    is_greedy: torch.Tensor  # [B] bool
    is_all_greedy: bool
    # Batch-wide flags over the non-greedy rows, so unused filters cost nothing.
    need_top_p_sampling: bool
    need_top_k_sampling: bool
    need_min_p_sampling: bool

    # Penalties ([B, 1], None when no row uses them) and their token state.
    frequency_penalties: torch.Tensor | None = None
    presence_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    output_token_counts: torch.Tensor | None = None  # [B, V] fp32, for frequency / presence
    repetition_mask: torch.Tensor | None = None  # [B, V] bool: token seen (output [+ prompt])

    # logit_bias as a sparse [B, V] add in COO form (None when no row has one).
    logit_bias_rows: torch.Tensor | None = None
    logit_bias_cols: torch.Tensor | None = None
    logit_bias_vals: torch.Tensor | None = None

    # min_new_tokens: per row, ids banned while output_lens[i] < min_new_tokens[i].
    min_new_tokens: list[int] = field(default_factory=list)
    min_new_ban_ids: list[list[int]] = field(default_factory=list)
    output_lens: list[int] = field(default_factory=list)
    min_new_rows: torch.Tensor | None = None  # active ban, COO
    min_new_cols: torch.Tensor | None = None

    # Seeded sampling.
    sampling_seeds: list[int | None] = field(default_factory=list)
    seeds_step: list[int] = field(default_factory=list)
    seeded_mask: torch.Tensor | None = None  # [B] bool, None when no row is seeded
    seeded_uniforms: torch.Tensor | None = None  # [B] fp32, u for seeded rows (0 elsewhere)

    # Structured outputs: one grammar (or None) per row; the packed mask and the function that
    # applies it (the grammar backend's static apply_vocab_mask). None when no row is constrained.
    grammars: list[Any] | None = None
    vocab_mask: torch.Tensor | None = None
    apply_mask_func: Callable[[torch.Tensor, torch.Tensor], None] | None = None

    # Custom logit processors: processor string -> (processor, its rows as a host list);
    # custom_params[i] is row i's params dict (with "__req__") or None.
    custom_logit_processor: dict[str, tuple[Any, list[int]]] = field(default_factory=dict)
    custom_params: list[dict | None] | None = None

    # Set by apply_logits_bias; the Sampler applies the bias itself unless this is already set,
    # so a caller that applied it first does not get penalties twice.
    logits_bias_applied: bool = False

    def __len__(self) -> int:
        return int(self.top_ps.shape[0])

    @property
    def batch_size(self) -> int:
        return len(self)

    @property
    def has_custom_logit_processor(self) -> bool:
        return bool(self.custom_logit_processor)

    @property
    def has_penalties(self) -> bool:
        return self.output_token_counts is not None or self.repetition_mask is not None

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        vocab_size: int,
        device: torch.device | str = "cpu",
        output_ids: list[list[int]] | None = None,
        seeds_step: list[int] | None = None,
        eos_token_ids: set[int] | None = None,
        prompt_ids: list[list[int]] | None = None,
        grammars: list[Any] | None = None,
        custom_logit_processors: list[str | None] | None = None,
        custom_params: list[dict | None] | None = None,
    ) -> "SamplingBatchInfo":
        """`output_ids[i]`: tokens request i generated so far. `seeds_step[i]` defaults to
        len(output_ids[i]) (0 without output_ids). `eos_token_ids`: banned, with each request's
        stop_token_ids, until min_new_tokens are out. `prompt_ids`: only for repetition penalty.
        `grammars[i]`: request i's grammar object or None. `custom_logit_processors[i]`: its
        serialised processor or None, called with `custom_params[i]` (a dict, "__req__" included)."""
        bs = len(params)
        if output_ids is not None and len(output_ids) != bs:
            raise ValueError(f"output_ids has {len(output_ids)} rows for a batch of {bs}")
        if seeds_step is not None and len(seeds_step) != bs:
            raise ValueError(f"seeds_step has {len(seeds_step)} rows for a batch of {bs}")
        if prompt_ids is not None and len(prompt_ids) != bs:
            raise ValueError(f"prompt_ids has {len(prompt_ids)} rows for a batch of {bs}")

        greedy = [p.temperature < SAMPLING_EPS or p.top_k == 1 for p in params]
        temps = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        top_ks = [1 if g else (vocab_size if p.top_k < 0 else min(int(p.top_k), vocab_size))
                  for p, g in zip(params, greedy)]
        top_ps = [float(p.top_p) for p in params]
        min_ps = [float(p.min_p) for p in params]
        sampled = [not g for g in greedy]

        # The per-row tensors every step needs, uploaded in one pinned non_blocking copy: a pageable
        # upload per tensor would wait for the device queue and undo the overlap scheduler's work.
        # (top_k <= vocab size < 2^24 is exact in fp32.)
        packed = upload(torch.tensor([temps, top_ps, min_ps, [float(k) for k in top_ks],
                                       [float(g) for g in greedy]], dtype=torch.float32).reshape(5, bs), device)
        info = cls(
            vocab_size=vocab_size,
            device=device,
            temperatures=packed[0].view(-1, 1),
            top_ps=packed[1],
            top_ks=packed[3].to(torch.int64),
            min_ps=packed[2],
            is_greedy=packed[4] > 0,
            is_all_greedy=all(greedy),
            need_top_p_sampling=any(s and p < 1.0 for s, p in zip(sampled, top_ps)),
            need_top_k_sampling=any(s and k < vocab_size for s, k in zip(sampled, top_ks)),
            need_min_p_sampling=any(s and m > 0.0 for s, m in zip(sampled, min_ps)),
        )

        outs = output_ids if output_ids is not None else [[] for _ in range(bs)]
        info._init_penalties(params, outs, prompt_ids)
        info._init_logit_bias(params)

        eos = set(eos_token_ids or ())
        info.min_new_tokens = [int(p.min_new_tokens) for p in params]
        info.min_new_ban_ids = [sorted(eos | set(p.stop_token_ids or ())) for p in params]
        info.output_lens = [len(o) for o in outs]
        info.sampling_seeds = [p.sampling_seed for p in params]
        info.seeds_step = list(seeds_step) if seeds_step is not None else list(info.output_lens)
        info._refresh_step_state()
        if grammars is not None and any(g is not None for g in grammars):
            if len(grammars) != bs:
                raise ValueError(f"grammars has {len(grammars)} rows for a batch of {bs}")
            info.grammars = list(grammars)
            info.update_regex_vocab_mask()
        if custom_logit_processors is not None and any(custom_logit_processors):
            info._init_custom_logit_processors(custom_logit_processors, custom_params)
        return info

    def _init_custom_logit_processors(self, procs: list[str | None], params: list[dict | None] | None) -> None:
        from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

        rows: dict[str, list[int]] = {}
        for i, s in enumerate(procs):
            if s:
                rows.setdefault(s, []).append(i)
        self.custom_logit_processor = {
            s: (CustomLogitProcessor.from_str(s), r) for s, r in rows.items()}
        self.custom_params = list(params) if params is not None else [None] * len(procs)

    def update_regex_vocab_mask(self) -> None:
        """Fill the batch's grammar mask on the host and upload it once (non_blocking)."""
        live = [g for g in (self.grammars or []) if g is not None]
        if not live:
            self.vocab_mask = self.apply_mask_func = None
            return
        first = live[0]
        # The grammar's vocabulary may exceed the logits' (a tokenizer larger than the embedding):
        # the mask is sized for the grammar and applied to the logits' columns.
        mask = first.allocate_vocab_mask(getattr(first, "vocab_size", self.vocab_size), len(self), self.device)
        for i, g in enumerate(self.grammars):
            if g is not None and not g.finished and not g.is_terminated():
                g.fill_vocab_mask(mask, i)
        self.vocab_mask = first.move_vocab_mask(mask, self.device)
        self.apply_mask_func = first.apply_vocab_mask  # a static method: one call for all rows

    def _init_penalties(self, params: list[SamplingParams], outs: list[list[int]],
                        prompt_ids: list[list[int]] | None) -> None:
        bs, vocab, dev = len(params), self.vocab_size, self.device
        freq = [float(p.frequency_penalty) for p in params]
        pres = [float(p.presence_penalty) for p in params]
        rep = [float(p.repetition_penalty) for p in params]
        if any(freq) or any(pres):
            self.frequency_penalties = torch.tensor(freq, dtype=torch.float32, device=dev).view(-1, 1)
            self.presence_penalties = torch.tensor(pres, dtype=torch.float32, device=dev).view(-1, 1)
            self.output_token_counts = torch.zeros(bs, vocab, dtype=torch.float32, device=dev)
            rows, cols = _coo(outs, dev)
            self.output_token_counts.index_put_((rows, cols), torch.ones_like(rows, dtype=torch.float32),
                                                accumulate=True)
        if any(r != 1.0 for r in rep):
            self.repetition_penalties = torch.tensor(rep, dtype=torch.float32, device=dev).view(-1, 1)
            self.repetition_mask = torch.zeros(bs, vocab, dtype=torch.bool, device=dev)
            seen = outs if prompt_ids is None else [list(p) + list(o) for p, o in zip(prompt_ids, outs)]
            rows, cols = _coo(seen, dev)
            self.repetition_mask[rows, cols] = True

    def _init_logit_bias(self, params: list[SamplingParams]) -> None:
        rows, cols, vals = [], [], []
        for i, p in enumerate(params):
            for k, v in (p.logit_bias or {}).items():
                tid = int(k)
                if not 0 <= tid < self.vocab_size:
                    raise ValueError(f"sampling_params.logit_bias token ids must be in "
                                     f"[0, {self.vocab_size}), got {k!r}")
                rows.append(i)
                cols.append(tid)
                vals.append(float(v))
        if rows:
            self.logit_bias_rows = torch.tensor(rows, dtype=torch.int64, device=self.device)
            self.logit_bias_cols = torch.tensor(cols, dtype=torch.int64, device=self.device)
            self.logit_bias_vals = torch.tensor(vals, dtype=torch.float32, device=self.device)

    def _refresh_step_state(self) -> None:
        """Recompute what depends on the step: the active min_new_tokens ban and seeded draws."""
        rows, cols = [], []
        for i, (n_min, n_out, ban) in enumerate(zip(self.min_new_tokens, self.output_lens, self.min_new_ban_ids)):
            if n_out < n_min and ban:
                rows.extend([i] * len(ban))
                cols.extend(ban)
        cols_ok = [c for c in cols if 0 <= c < self.vocab_size]
        if len(cols_ok) != len(cols):
            raise ValueError(f"eos/stop token id out of vocab [0, {self.vocab_size}): {sorted(set(cols) - set(cols_ok))}")
        if rows:
            self.min_new_rows = torch.tensor(rows, dtype=torch.int64, device=self.device)
            self.min_new_cols = torch.tensor(cols, dtype=torch.int64, device=self.device)
        else:
            self.min_new_rows = self.min_new_cols = None

        if any(s is not None for s in self.sampling_seeds):
            mask = [s is not None for s in self.sampling_seeds]
            us = [seeded_uniform(s, st) if s is not None else 0.0
                  for s, st in zip(self.sampling_seeds, self.seeds_step)]
            self.seeded_mask = torch.tensor(mask, dtype=torch.bool, device=self.device)
            self.seeded_uniforms = torch.tensor(us, dtype=torch.float32, device=self.device)
        else:
            self.seeded_mask = self.seeded_uniforms = None

    # -- per step ---------------------------------------------------------------------------
    @property
    def logit_bias(self) -> torch.Tensor | None:
        """The bias as a sparse COO [B, V] tensor (for inspection; apply_logits_bias uses COO)."""
        if self.logit_bias_rows is None:
            return None
        idx = torch.stack([self.logit_bias_rows, self.logit_bias_cols])
        return torch.sparse_coo_tensor(idx, self.logit_bias_vals, (len(self), self.vocab_size),
                                       check_invariants=True).coalesce()

    def apply_logits_bias(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalties, the grammar mask, logit_bias and the min_new_tokens ban, in place on [B, V]."""
        if self.repetition_mask is not None:
            pen = torch.where(self.repetition_mask, self.repetition_penalties, 1.0)
            # Scaling (CTRL / HF): push seen tokens towards "less likely" whatever the sign.
            logits.copy_(torch.where(logits > 0, logits / pen, logits * pen))
        if self.output_token_counts is not None:
            logits.sub_(self.frequency_penalties * self.output_token_counts)
            logits.sub_(self.presence_penalties * (self.output_token_counts > 0))
        if self.vocab_mask is not None:
            self.apply_mask_func(logits, self.vocab_mask)
        if self.logit_bias_rows is not None:
            logits.index_put_((self.logit_bias_rows, self.logit_bias_cols),
                              self.logit_bias_vals.to(logits.dtype), accumulate=True)
        if self.min_new_rows is not None:
            logits[self.min_new_rows, self.min_new_cols] = float("-inf")
        self.logits_bias_applied = True
        return logits

    def cumulate_output_tokens(self, next_token_ids: torch.Tensor | list[int]) -> None:
        """Advance one decode step: count the new tokens, bump steps, refresh step state."""
        ids = torch.as_tensor(next_token_ids, dtype=torch.int64, device=self.device).view(-1)
        rows = torch.arange(len(self), device=self.device)
        if self.output_token_counts is not None:
            self.output_token_counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32),
                                                accumulate=True)
        if self.repetition_mask is not None:
            self.repetition_mask[rows, ids] = True
        self.output_lens = [n + 1 for n in self.output_lens]
        self.seeds_step = [n + 1 for n in self.seeds_step]
        self._refresh_step_state()
        self.logits_bias_applied = False


def _coo(lists: list[list[int]], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [i for i, toks in enumerate(lists) for _ in toks]
    cols = [t for toks in lists for t in toks]
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(cols, dtype=torch.int64, device=device))
