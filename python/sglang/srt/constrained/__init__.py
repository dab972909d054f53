"""Grammar-constrained decoding (structured outputs): json_schema / regex / ebnf / structural_tag.

Import-light on purpose: constants only (request fields, messages), which the backends import; the
--grammar-backend choices live in the registry (grammar_registry.py), which imports backends on use.
"""

# Request fields -> the grammar kind upstream keys its compile cache with.
GRAMMAR_FIELDS = {"json_schema": "json", "regex": "regex", "ebnf": "ebnf", "structural_tag": "structural_tag"}
KIND_TO_FIELD = {kind: name for name, kind in GRAMMAR_FIELDS.items()}

STRUCTURED_OUTPUTS_DISABLED = ("structured outputs are disabled on this server (--grammar-backend none): "
                               "json_schema, regex, ebnf and structural_tag are not accepted")
