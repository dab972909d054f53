"""Per-request sampling parameters (names and defaults follow upstream SGLang).

Lifecycle: `SamplingParams.from_dict(request_json)` -> `normalize(tokenizer)` -> `verify(vocab_size)`.
The object keeps the user's values as given (temperature 0 stays 0 here); the greedy rewrite
(temperature < 1e-6 -> top_k = 1 semantics) happens in `SamplingBatchInfo`, so `to_dict()` reports
what the client sent.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.constrained import GRAMMAR_FIELDS

# Below this temperature a request is greedy (argmax); dividing by it would overflow anyway.
SAMPLING_EPS = 1e-6
# top_k value meaning "no top-k filtering".
TOP_K_ALL = -1
GRAMMAR_FIELD_NAMES = tuple(GRAMMAR_FIELDS)  # json_schema, regex, ebnf, structural_tag
# Fields whose JSON null is a value, not "the default": max_new_tokens null = bounded only by the
# context (upstream: SamplingParams(max_new_tokens=None); the OpenAI routes send it when the client
# sets no max_tokens).
NULL_IS_A_VALUE = frozenset({"max_new_tokens"})


MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a seeded n > 1 request (0: the seed itself). OpenAI's and vLLM's
    n choices of one seeded request differ from each other and repeat across runs; so do ours."""
    return seed if index == 0 else splitmix64((seed & MASK64) ^ splitmix64(index)) >> 1


@dataclass
class SamplingParams:
    # None (JSON null too) = limited only by the context length (upstream semantics); absent = 128.
    max_new_tokens: int | None = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    sampling_seed: int | None = None
    no_stop_trim: bool = False
    logit_bias: dict[str | int, float] | None = None
    # Structured outputs (at most one per request; compiled by --grammar-backend).
    json_schema: str | None = None  # a JSON schema, serialised (an object is serialised by normalize())
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None  # upstream's {"structures": [...], "triggers": [...]} as JSON text
    # Free-form parameters for the request's custom logit processor (needs
    # --enable-custom-logit-processor); the processor also gets this request as "__req__".
    custom_params: dict[str, Any] | None = None
    # Derived by normalize(): longest stop string, in tokens (chars without a tokenizer); the
    # detokenizer holds back this much text before streaming so a stop string is never leaked.
    stop_str_max_len: int = field(default=0, init=False, repr=False, compare=False)
    # Set by the chat handler (never by the client) when the request thinks before its grammar
    # applies: the end-of-think marker's token ids (constrained/reasoner_grammar_backend.py).
    think_end_ids: list[int] | None = field(default=None, init=False, repr=False, compare=False)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.init]

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "SamplingParams":
        """Build from a request dict. Unknown keys raise ValueError (typos must not be silently
        ignored); `seed` is accepted as an alias of `sampling_seed`; JSON null means "default"
        (except in NULL_IS_A_VALUE)."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        d = dict(d)
        if "seed" in d:
            seed = d.pop("seed")
            if d.get("sampling_seed") is not None and seed is not None and d["sampling_seed"] != seed:
                raise ValueError("sampling_params: 'seed' and 'sampling_seed' are both given and differ")
            if d.get("sampling_seed") is None:
                d["sampling_seed"] = seed
        names = cls.field_names()
        unknown = sorted(k for k in d if k not in names)
        if unknown:
            raise ValueError(f"sampling_params: unknown parameter(s) {', '.join(map(repr, unknown))}; "
                             f"allowed: {', '.join(names)} (and 'seed')")
        defaults = cls()
        kwargs = {}
        for k, v in d.items():
            # null keeps the default, except where None is itself a meaningful value.
            keep_default = v is None and getattr(defaults, k) is not None and k not in NULL_IS_A_VALUE
            kwargs[k] = getattr(defaults, k) if keep_default else v
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The constructor fields only, so that from_dict(p.to_dict()) == p."""
        out = {}
        for name in self.field_names():
            v = getattr(self, name)
            out[name] = list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v
        return out

    def for_choice(self, index: int) -> "SamplingParams":
        """The parameters of choice `index` of an n > 1 request: the same, except that a seeded
        request's choices draw from different streams (choice_seed); choice 0 is the n = 1 request."""
        if index == 0 or self.sampling_seed is None:
            return self
        out = copy.copy(self)
        out.sampling_seed = choice_seed(self.sampling_seed, index)
        return out

    # -- normalisation ------------------------------------------------------------------------
    @property
    def stop_strs(self) -> list[str]:
        """Upstream's name for the normalised stop list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def normalize(self, tokenizer: Any = None) -> None:
        """Canonicalise in place: stop -> list[str], stop_token_ids -> de-duplicated list[int],
        logit_bias keys -> int; compute stop_str_max_len (tokens with a tokenizer, else chars)."""
        # Wrong types are left as they are: verify() reports them with the parameter's name.
        if self.stop is None or self.stop == "":
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        max_len = 0
        for s in self.stop if isinstance(self.stop, list) else []:
            if not isinstance(s, str):
                continue  # verify() reports it
            if tokenizer is not None:
                max_len = max(max_len, len(tokenizer.encode(s, add_special_tokens=False)))
            else:
                max_len = max(max_len, len(s))
        self.stop_str_max_len = max_len

        if isinstance(self.stop_token_ids, (list, tuple)):
            try:
                self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
            except TypeError:  # unhashable entries: verify() names them
                pass
        if isinstance(self.logit_bias, dict) and self.logit_bias:
            # OpenAI sends token ids as JSON object keys, i.e. strings.
            norm: dict[str | int, float] = {}
            for k, v in self.logit_bias.items():
                key = _as_token_id(k)
                norm[key if key is not None else k] = v
            self.logit_bias = norm
        if isinstance(self.json_schema, (dict, bool)):  # a schema given as an object, not as text
            self.json_schema = json.dumps(self.json_schema)
        if isinstance(self.structural_tag, dict):
            self.structural_tag = json.dumps(self.structural_tag)

    @property
    def grammar_fields(self) -> list[str]:
        """The structured-output fields this request sets (verify() allows at most one)."""
        return [name for name in GRAMMAR_FIELD_NAMES if getattr(self, name) is not None]

    # -- validation ---------------------------------------------------------------------------
    def verify(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the parameter and its allowed range for the first bad value."""
        _check_int("max_new_tokens", self.max_new_tokens, allow_none=True)
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            _bad("max_new_tokens", self.max_new_tokens, "must be >= 0")
        _check_int("min_new_tokens", self.min_new_tokens)
        if self.min_new_tokens < 0:
            _bad("min_new_tokens", self.min_new_tokens, "must be >= 0")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            _bad("min_new_tokens", self.min_new_tokens,
                 f"must be in [0, max_new_tokens={self.max_new_tokens}]")

        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            _bad("temperature", self.temperature, "must be >= 0 (0 = greedy)")
        _check_float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            _bad("top_p", self.top_p, "must be in (0, 1]")
        _check_int("top_k", self.top_k)
        if self.top_k == 0 or self.top_k < -1:
            _bad("top_k", self.top_k, "must be -1 (disabled) or >= 1")
        _check_float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            _bad("min_p", self.min_p, "must be in [0, 1]")
        _check_float("frequency_penalty", self.frequency_penalty)
        if not -2 <= self.frequency_penalty <= 2:
            _bad("frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        _check_float("presence_penalty", self.presence_penalty)
        if not -2 <= self.presence_penalty <= 2:
            _bad("presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        _check_float("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty <= 2:
            _bad("repetition_penalty", self.repetition_penalty, "must be in (0, 2]")

        _check_int("n", self.n)
        if self.n < 1:
            _bad("n", self.n, "must be >= 1")
        _check_int("sampling_seed", self.sampling_seed, allow_none=True)
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                _bad(name, getattr(self, name), "must be a boolean")

        if self.stop is not None and not isinstance(self.stop, str):
            if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
                _bad("stop", self.stop, "must be a string or a list of strings")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple, set)):
                _bad("stop_token_ids", self.stop_token_ids, "must be a list of token ids")
            for t in self.stop_token_ids:
                _check_token_id("stop_token_ids", t, vocab_size)

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                _bad("logit_bias", self.logit_bias, "must be an object mapping token id -> bias")
            for k, v in self.logit_bias.items():
                tid = _as_token_id(k)
                if tid is None:
                    _bad("logit_bias", k, "keys must be integer token ids")
                _check_token_id("logit_bias", tid, vocab_size)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                    _bad("logit_bias", v, f"value for token {k} must be a number in [-100, 100] (as OpenAI)")

        grammar = self.grammar_fields
        if len(grammar) > 1:
            _bad(grammar[0], ", ".join(grammar),
                 "cannot be combined with another structured-output constraint: give at most one of "
                 + ", ".join(GRAMMAR_FIELD_NAMES))
        for name in grammar:
            v = getattr(self, name)
            if not isinstance(v, str) or not v.strip():
                _bad(name, v, "must be a non-empty string")
        if self.custom_params is not None and not isinstance(self.custom_params, dict):
            _bad("custom_params", self.custom_params, "must be an object")


# -- helpers -------------------------------------------------------------------------------------
def _bad(name: str, value: Any, reason: str) -> None:
    raise ValueError(f"sampling_params.{name} {reason}, got {value!r}")


def _check_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    # bool is an int subclass; `top_k: true` is a client bug, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        _bad(name, value, "must be an integer" + (" or null" if allow_none else ""))


def _check_float(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        _bad(name, value, "must be a finite number")


def _as_token_id(key: Any) -> int | None:
    if isinstance(key, bool):
        return None
    if isinstance(key, int):
        return key
    if isinstance(key, str):
        try:
            return int(key.strip())
        except ValueError:
            return None
    return None


def _check_token_id(name: str, tid: Any, vocab_size: int | None) -> None:
    if isinstance(tid, bool) or not isinstance(tid, int):
        _bad(name, tid, "token ids must be integers")
    hi = f"{vocab_size})" if vocab_size is not None else "inf)"
    if tid < 0 or (vocab_size is not None and tid >= vocab_size):
        _bad(name, tid, f"token ids must be in [0, {hi}")
