"""Grammar backends by name (the --grammar-backend choices) and the factory that builds one.

Import-light: classes are named as "module:Class" and imported on use, so ServerArgs can list the
names without importing xgrammar, and the base module never imports its subclasses.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang.srt.constrained.base_grammar_backend import BaseGrammarBackend

logger = logging.getLogger(__name__)

GRAMMAR_BACKEND_REGISTRY: dict[str, str] = {
    "xgrammar": "sglang.srt.constrained.xgrammar_backend:XGrammarGrammarBackend",
}
# "none" turns structured outputs off (create_grammar_backend returns None).
GRAMMAR_BACKENDS = [*GRAMMAR_BACKEND_REGISTRY, "none"]


def create_grammar_backend(server_args, tokenizer, vocab_size: int,
                           eos_token_ids: list[int] | None = None) -> "BaseGrammarBackend | None":
    """The backend named by --grammar-backend; None for `none` (structured outputs disabled); an
    UnavailableGrammarBackend (a warning, then a 400 per grammar request) when its package is missing.
    `eos_token_ids`: the model's EOS ids (the grammar's stop tokens, with the tokenizer's EOS)."""
    name = server_args.grammar_backend
    if name == "none":
        return None
    if name not in GRAMMAR_BACKEND_REGISTRY:
        raise ValueError(f"invalid grammar backend {name!r}; choose from {GRAMMAR_BACKENDS}")
    module, cls = GRAMMAR_BACKEND_REGISTRY[name].split(":")
    try:
        backend_cls = getattr(importlib.import_module(module), cls)
    except ImportError as e:
        # Plain completions must not need the package: warn, and refuse only the requests that
        # need a grammar (a 400 naming their field).
        from sglang.srt.constrained.base_grammar_backend import UnavailableGrammarBackend

        message = (f"--grammar-backend {name} needs the {name} package, which is not installed ({e}); "
                   f"install it (pip install {name}) to use structured outputs")
        logger.warning("%s. Requests with json_schema / regex / ebnf / structural_tag / response_format / "
                       "forced tool calls will be refused; start with --grammar-backend none to silence this.",
                       message)
        return UnavailableGrammarBackend(message)
    return backend_cls(tokenizer, vocab_size=vocab_size, eos_token_ids=eos_token_ids,
                       any_whitespace=not server_args.constrained_json_disable_any_whitespace)
