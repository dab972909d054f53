"""--speculative-adaptive: drafting switched off while it does not pay, and probed back on.

A speculative step costs more than a plain decode step: the verify computes num_steps + 1 rows per
request (on an MoE model they touch more experts: 1.27x a plain step at batch 1 on 12 V3.2 layers x
16 experts, H100) and the draft runs num_steps forwards (the whole step: ~1.6x plain). It pays only
while a step yields more tokens than that, i.e. while enough drafts are accepted. The policy keeps
an exponential mean of the accepted drafts per request and step; below `off_below` the worker
decodes one row per request (the draft still extends over it, so its KV and hidden state stay
current), trying one speculative step every `probe_every` steps; at `on_at` or above drafting
resumes. Output is unchanged either way: every token is the target's own pick.

Upstream SGLang's `--speculative-adaptive` moves num_steps between candidates; this one has the two
candidates that matter for a one-layer MTP draft: num_steps and none.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AdaptiveDrafting:
    off_below: float = 0.5  # accepted drafts per request-step (break-even ~0.6 at batch 1 above)
    on_at: float = 0.8
    probe_every: int = 16  # steps without drafts between two speculative probes
    alpha: float = 0.25  # weight of the newest step in the mean
    mean: float | None = None
    drafting: bool = True
    since_probe: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.off_below <= self.on_at:
            raise ValueError(f"AdaptiveDrafting: need 0 <= off_below ({self.off_below}) <= on_at ({self.on_at})")
        if self.probe_every < 1 or not 0 < self.alpha <= 1:
            raise ValueError(f"AdaptiveDrafting: probe_every {self.probe_every} >= 1, alpha {self.alpha} in (0, 1]")

    def reset(self) -> None:
        """Back to the start: drafting, no history."""
        self.mean, self.drafting, self.since_probe = None, True, 0

    def drafts_next(self) -> bool:
        """Whether the next decode step drafts (pure: the scheduler asks before the step is built)."""
        return self.drafting or self.since_probe + 1 >= self.probe_every

    def on_step(self) -> bool:
        """A decode step is run: whether it drafts (advances the probe counter)."""
        drafts = self.drafts_next()
        self.since_probe = 0 if drafts else self.since_probe + 1
        return drafts

    def observe(self, accepted_drafts: int, rows: int) -> None:
        """A speculative step's result: `accepted_drafts` over `rows` live requests."""
        if rows <= 0:
            return
        x = accepted_drafts / rows
        self.mean = x if self.mean is None else (1 - self.alpha) * self.mean + self.alpha * x
        if self.drafting and self.mean < self.off_below:
            self.drafting = False
        elif not self.drafting and self.mean >= self.on_at:
            self.drafting = True
