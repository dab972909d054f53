"""Base classes of grammar-guided constrained decoding (upstream SGLang's names and methods).

Rules:
- A `BaseGrammarObject` is one request's matcher state. It is owned by that request's `Req` and by
  nobody else: `copy()` hands out a fresh matcher over the shared compiled grammar, so requests
  never share mutable state, and dropping the `Req` (finish, abort) drops it.
- Per step the batch's mask is filled on the host (`allocate_vocab_mask` once for the batch,
  `fill_vocab_mask(mask, i)` per constrained row; rows of other requests allow everything) and
  moved to the device once (`move_vocab_mask`), then `apply_vocab_mask` sets the disallowed logits
  to -inf. `SamplingBatchInfo` owns the mask.
- After sampling, each constrained request `accept_token`s its token; `is_terminated()` (the
  grammar accepted a stop token) finishes the request.
- `BaseGrammarBackend` compiles in a thread pool and caches by (kind, text) (LRU, bounded), where
  kind is one of "json", "regex", "ebnf", "structural_tag". A text that fails to compile is cached as an
  `InvalidGrammar` carrying the error, so a bad schema sent twice is not compiled twice.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from sglang.srt.constrained import GRAMMAR_FIELDS, KIND_TO_FIELD

logger = logging.getLogger(__name__)
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")


class BaseGrammarObject:
    def __init__(self) -> None:
        self._finished = False

    def accept_token(self, token: int) -> bool:
        """Advance by `token`; False (state unchanged) if the grammar does not allow it."""
        raise NotImplementedError

    def allocate_vocab_mask(self, vocab_size: int, batch_size: int, device) -> torch.Tensor:
        raise NotImplementedError

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        raise NotImplementedError

    @staticmethod
    def move_vocab_mask(vocab_mask: torch.Tensor, device) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
        raise NotImplementedError

    def is_terminated(self) -> bool:
        raise NotImplementedError

    def copy(self) -> "BaseGrammarObject":
        raise NotImplementedError

    @property
    def finished(self) -> bool:
        return self._finished

    @finished.setter
    def finished(self, finished: bool) -> None:
        self._finished = finished


class InvalidGrammar:
    """A (kind, text) that did not compile; cached like a grammar so it is not compiled again."""

    def __init__(self, kind: str, message: str) -> None:
        self.kind, self.message = kind, message

    @property
    def field(self) -> str:
        return KIND_TO_FIELD.get(self.kind, self.kind)

    def error_message(self) -> str:
        return f"sampling_params.{self.field} is not a valid {_KIND_NAMES.get(self.kind, self.kind)}: {self.message}"

    def copy(self) -> "InvalidGrammar":
        return self


_KIND_NAMES = {"json": "JSON schema", "regex": "regular expression", "ebnf": "EBNF grammar",
               "structural_tag": "structural tag"}


class BaseGrammarBackend:
    """Compiles (kind, text) keys in a thread pool, caching the compiled result (or its error).

    `get_cached_or_future_value(key)` never blocks: it returns `(grammar_copy, True)` on a cache
    hit (an `InvalidGrammar` for a known-bad key), else `(future, False)`; the future resolves to
    a fresh grammar object or an `InvalidGrammar`. Concurrent misses on one key share one compile.
    """

    def __init__(self, max_workers: int = 2, max_cache_entries: int = 1024) -> None:
        self.executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        # Least recently used first; a request holds its own matcher, so eviction is always safe.
        self.cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self.max_cache_entries = max_cache_entries
        self._pending: dict[tuple[str, str], Future] = {}
        self._lock = threading.Lock()
        self.num_compiles = 0  # compilations started (tests check the cache with it)

    # -- per kind (subclasses override what they support) ------------------------------------------
    def dispatch_json(self, key_string: str) -> BaseGrammarObject:
        raise ValueError("json_schema is not supported by this grammar backend")

    def dispatch_regex(self, key_string: str) -> BaseGrammarObject:
        raise ValueError("regex is not supported by this grammar backend")

    def dispatch_ebnf(self, key_string: str) -> BaseGrammarObject:
        raise ValueError("ebnf is not supported by this grammar backend")

    def dispatch_structural_tag(self, key_string: str) -> BaseGrammarObject:
        raise ValueError("structural_tag is not supported by this grammar backend")

    def _init_value_dispatch(self, key: tuple[str, str]) -> BaseGrammarObject | InvalidGrammar:
        kind, text = key
        fn = {"json": self.dispatch_json, "regex": self.dispatch_regex, "ebnf": self.dispatch_ebnf,
              "structural_tag": self.dispatch_structural_tag}.get(kind)
        if fn is None:
            return InvalidGrammar(kind, f"unknown grammar kind {kind!r}")
        try:
            return fn(text)
        except Exception as e:  # the compiler's own error types vary; all mean "bad grammar"
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            msg = _CPP_PREFIX.sub("", msg)  # "[hh:mm:ss] /path/file.cc:94: " from native compilers
            logger.info("invalid %s grammar: %s", kind, msg)
            return InvalidGrammar(kind, msg)

    # -- cache ------------------------------------------------------------------------------------
    def get_cached_or_future_value(self, key: tuple[str, str]) -> tuple[Any, bool]:
        with self._lock:
            value = self.cache.get(key)
            if value is not None:
                self.cache.move_to_end(key)
                return value.copy(), True
            fut = self._pending.get(key)
            if fut is None:
                self.num_compiles += 1
                fut = self.executor.submit(self._compile_and_cache, key)
                self._pending[key] = fut
        out: Future = Future()
        fut.add_done_callback(lambda f: _resolve_copy(f, out))
        return out, False

    def _compile_and_cache(self, key: tuple[str, str]):
        value = self._init_value_dispatch(key)
        with self._lock:
            self.cache[key] = value
            while len(self.cache) > self.max_cache_entries:
                self.cache.popitem(last=False)
            self._pending.pop(key, None)
        return value

    def validate(self, key: tuple[str, str], timeout: float | None = None) -> str | None:
        """Compile (or look up) `key`, blocking; the error message naming the field, or None."""
        value, hit = self.get_cached_or_future_value(key)
        if not hit:
            value = value.result(timeout)
        return value.error_message() if isinstance(value, InvalidGrammar) else None

    def reset(self) -> None:
        with self._lock:
            self.cache.clear()

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class UnavailableGrammar(InvalidGrammar):
    """What every grammar of an UnavailableGrammarBackend resolves to."""

    def error_message(self) -> str:
        return f"sampling_params.{self.field} cannot be served: {self.message}"


class UnavailableGrammarBackend(BaseGrammarBackend):
    """The configured backend's package is missing: nothing compiles, every grammar request is
    refused (a cached `UnavailableGrammar`, so the tokenizer manager answers 400 naming the field
    and the scheduler aborts with 400), and requests without a grammar are served as usual."""

    def __init__(self, message: str) -> None:
        super().__init__(max_workers=1)
        self.message = message

    def get_cached_or_future_value(self, key: tuple[str, str]) -> tuple[Any, bool]:
        return UnavailableGrammar(key[0], self.message), True


def _resolve_copy(src: Future, dst: Future) -> None:
    """Each waiter gets its own matcher: the shared compiled value is copied per request."""
    try:
        dst.set_result(src.result().copy())
    except Exception as e:  # pragma: no cover - _compile_and_cache does not raise
        dst.set_exception(e)


def grammar_key(sampling_params) -> tuple[str, str] | None:
    """(kind, text) of a request's grammar, or None. SamplingParams.verify ensures at most one."""
    for name, kind in GRAMMAR_FIELDS.items():
        text = getattr(sampling_params, name, None)
        if text is not None:
            return kind, text
    return None

