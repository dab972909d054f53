"""Error types that modules of every layer raise: a leaf (it imports nothing of the package), so a
storage or config module can name a flag without importing server_args and what it imports."""

from __future__ import annotations


class ServerArgsError(ValueError):
    """A flag (or a combination of flags) the server cannot start with; the message names it."""

    def __init__(self, flag: str, reason: str) -> None:
        self.flag, self.reason = flag, reason
        super().__init__(f"--{flag.replace('_', '-')}: {reason}")
