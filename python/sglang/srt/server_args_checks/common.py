"""What every flag group's checks share: ServerArgs' validators are methods of mixins, one module
per flag group (model, parallel, serving, speculative, hicache, disaggregation); ServerArgs stays the
one dataclass and `ServerArgs.validate()` runs the groups' checks in a fixed order."""

from __future__ import annotations

import dataclasses

from sglang.srt.errors import ServerArgsError


class FlagChecks:
    """Helpers of the per-group checks; `self` is a ServerArgs."""

    def _positive(self, name: str, allow_none: bool = True) -> None:
        v = getattr(self, name)
        if v is None and allow_none:
            return
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ServerArgsError(name, f"must be a positive integer, got {v!r}")

    def _choice(self, name: str) -> None:
        f = next(x for x in dataclasses.fields(self) if x.name == name)
        choices = f.metadata.get("choices")
        if choices and getattr(self, name) not in choices:
            raise ServerArgsError(name, f"{getattr(self, name)!r} is not one of {choices}")
