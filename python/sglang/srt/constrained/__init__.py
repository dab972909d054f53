"""Grammar-constrained decoding (structured outputs): json_schema / regex / ebnf / structural_tag.

Import-light on purpose: server_args reads GRAMMAR_BACKENDS from here (the flag's choices come from
the registry, grammar_registry.py, so they cannot drift); the backends themselves are imported lazily.
"""

from sglang.srt.constrained.grammar_registry import GRAMMAR_BACKENDS  # noqa: F401

# Request fields -> the grammar kind upstream keys its compile cache with.
GRAMMAR_FIELDS = {"json_schema": "json", "regex": "regex", "ebnf": "ebnf", "structural_tag": "structural_tag"}
KIND_TO_FIELD = {kind: name for name, kind in GRAMMAR_FIELDS.items()}

STRUCTURED_OUTPUTS_DISABLED = ("structured outputs are disabled on this server (--grammar-backend none): "
                               "json_schema, regex, ebnf and structural_tag are not accepted")
