"""Notices a scheduler that holds waiting requests but launches nothing: a wedge.

With nothing running and nothing in flight, a waiting request is admitted at once unless an
admission rule is wrong (the request asks for more KV than the pool can ever give it) or KV is held
by something that does not release it. Either way no step would ever run again while `/health`
stays 200, so the watchdog says why, in the log and in the scheduler's stats, which
`/health_generate` reads before it tries a generation.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

logger = logging.getLogger(__name__)

STALL_STEPS = 64  # consecutive iterations that launch nothing while requests wait ...
STALL_SECONDS = 5.0  # ... and for at least this long (a HiCache / L3 load may take a while)
REPEAT_LOG_SECONDS = 60.0


class AdmissionWatchdog:
    def __init__(self, min_steps: int | None = None, min_seconds: float | None = None) -> None:
        self.min_steps = STALL_STEPS if min_steps is None else min_steps
        self.min_seconds = STALL_SECONDS if min_seconds is None else min_seconds
        self._steps = 0
        self._since = 0.0
        self._logged_at: float | None = None
        self.reason: str | None = None  # set while stalled

    def observe(self, stalled: bool, explain: Callable[[], str]) -> None:
        """Once per iteration. `stalled`: requests wait, nothing was launched and nothing is in
        flight. `explain()` (called only once the stall is long enough) says why nothing was admitted."""
        if not stalled:
            if self.reason is not None:
                logger.warning("scheduler admits requests again after a stall of %.1f s",
                               time.monotonic() - self._since)
            self._steps, self.reason, self._logged_at = 0, None, None
            return
        now = time.monotonic()
        if self._steps == 0:
            self._since = now
        self._steps += 1
        if self._steps < self.min_steps or now - self._since < self.min_seconds:
            return
        self.reason = (f"no request admitted for {now - self._since:.1f} s ({self._steps} scheduler iterations) "
                       f"while requests wait: {explain()}")
        if self._logged_at is None or now - self._logged_at >= REPEAT_LOG_SECONDS:
            self._logged_at = now
            logger.error("admission stall: %s", self.reason)

