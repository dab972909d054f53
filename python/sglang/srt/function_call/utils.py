"""JSON helpers for tool calls: canonical streaming re-serialisation and the required-call schema."""

from __future__ import annotations

import json
from typing import Any

_WS = " \t\r\n"
_SCALAR_END = _WS + ',:]}[{"'


def dumps_args(value: Any) -> str:
    """The one serialisation of tool arguments (upstream's `json.dumps(..., ensure_ascii=False)`,
    default separators `", "` / `": "`)."""
    return json.dumps(value, ensure_ascii=False)


def _loads(text: str) -> Any:
    # strict=False: models do put raw newlines/tabs inside JSON strings; accept them the same
    # way in every mode rather than dropping the call.
    return json.loads(text, strict=False)


class JsonCanonicalStream:
    """Re-serialises growing JSON text exactly as `dumps_args(json.loads(text))` would.

    Only output that can no longer change is emitted: structural characters at once, strings
    piece by piece (never splitting an escape or a surrogate pair), numbers and literals once
    a delimiter ends them. Whitespace of the source is dropped; separators are canonical.
    Duplicate object keys are the one divergence (json.loads keeps the last; this keeps both).
    """

    def __init__(self) -> None:
        self._raw = ""
        self._pos = 0  # next unread index in _raw
        self._depth = 0
        self._in_string = False
        self._str_safe = 0  # raw index up to which an open string's content was emitted
        self._str_scan = 0  # raw index where the search for its closing quote resumes
        self.done = False  # the top-level value is complete
        self.error = False
        self.emitted = ""

    def feed(self, text: str, final: bool = False) -> str:
        self._raw += text
        out: list[str] = []
        raw = self._raw
        while self._pos < len(raw) and not self.error:
            if self._in_string:
                if not self._continue_string(out):
                    break
                continue
            c = raw[self._pos]
            if c in _WS:
                self._pos += 1
            elif self.done:
                self.error = True
            elif c in "{[":
                out.append(c)
                self._depth += 1
                self._pos += 1
            elif c in "}]":
                out.append(c)
                self._depth -= 1
                self._pos += 1
                self.error = self._depth < 0
                self.done = self._depth == 0
            elif c in ",:":
                out.append(c + " ")
                self._pos += 1
            elif c == '"':
                out.append('"')
                self._in_string = True
                self._pos += 1
                self._str_safe = self._str_scan = self._pos
            else:
                end = self._pos
                while end < len(raw) and raw[end] not in _SCALAR_END:
                    end += 1
                if end == len(raw) and not final:
                    break  # "1" may still become "12"
                try:
                    out.append(dumps_args(_loads(raw[self._pos:end])))
                except ValueError:
                    self.error = True
                    break
                self._pos = end
                self.done = self._depth == 0
        piece = "".join(out)
        self.emitted += piece
        return piece

    def _continue_string(self, out: list[str]) -> bool:
        """Emit what is safe of the open string; True when it closed."""
        raw = self._raw
        k = self._str_scan
        while k < len(raw):
            ch = raw[k]
            if ch == "\\":
                if k + 1 >= len(raw):
                    break
                k += 2
                continue
            if ch == '"':
                try:
                    text = _loads('"' + raw[self._str_safe:k] + '"')
                except ValueError:
                    self.error = True
                    return False
                out.append(dumps_args(text)[1:])  # rest of the content + closing quote
                self._pos = k + 1
                self._in_string = False
                self.done = self._depth == 0
                return True
            k += 1
        self._str_scan = k
        seg = raw[self._str_safe:k]
        # Back off over an unfinished \uXXXX escape or a high surrogate whose pair is unseen.
        for trim in range(0, min(len(seg), 12) + 1):
            piece = seg[: len(seg) - trim]
            try:
                text = _loads('"' + piece + '"')
            except ValueError:
                continue
            if text and "\ud800" <= text[-1] <= "\udbff":
                continue
            if text:
                out.append(dumps_args(text)[1:-1])
                self._str_safe += len(piece)
            break
        self._pos = len(raw)
        return False

    def finish(self) -> str:
        """Flush a trailing scalar; returns the last piece. Check `.done and not .error` after."""
        return self.feed("", final=True)


def tools_by_name(tools: list[Any] | None) -> dict[str, dict]:
    """OpenAI tool dicts (or objects with `.function`) -> {name: parameters schema}."""
    out: dict[str, dict] = {}
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else getattr(tool, "function", None)
        if fn is None:
            continue
        name = fn.get("name") if isinstance(fn, dict) else getattr(fn, "name", None)
        params = fn.get("parameters") if isinstance(fn, dict) else getattr(fn, "parameters", None)
        if name:
            out[name] = params if isinstance(params, dict) else {}
    return out


def _tool_schema(name: str, parameters: dict) -> dict:
    return {
        "properties": {
            "name": {"type": "string", "enum": [name]},
            "parameters": parameters or {"type": "object", "properties": {}},
        },
        "required": ["name", "parameters"],
    }


def _lift_defs(schema: dict, tools: dict[str, dict]) -> dict:
    # "$ref": "#/$defs/X" inside a tool's parameters resolves against the document root, so the
    # tools' $defs must live at the root of the array schema; conflicting definitions are an error.
    defs: dict[str, Any] = {}
    for name, params in tools.items():
        for key, value in (params.get("$defs") or {}).items():
            if key in defs and defs[key] != value:
                raise ValueError(f"Tool {name!r} redefines $defs/{key} differently")
            defs[key] = value
    if defs:
        schema["$defs"] = defs
    return schema


def get_json_schema_constraint(
    tools: list[Any], tool_choice: Any, parallel_tool_calls: bool = True
) -> dict | None:
    """JSON schema forcing tool calls, as upstream builds it for the grammar backend.

    tool_choice "required": an array (minItems 1) of `{"name": <enum>, "parameters": <schema>}`
    objects, anyOf over all tools. A named choice (`{"type": "function", "function": {"name": X}}`
    or an object with `.function.name`): the same array restricted to X (None if X is unknown).
    Anything else ("auto", "none", None): None. `parallel_tool_calls=False` adds maxItems 1.
    """
    by_name = tools_by_name(tools)
    if isinstance(tool_choice, dict):
        chosen = (tool_choice.get("function") or {}).get("name")
    elif hasattr(tool_choice, "function"):
        chosen = getattr(tool_choice.function, "name", None)
    else:
        chosen = None
    if chosen is not None:
        if chosen not in by_name:
            return None
        selected = {chosen: by_name[chosen]}
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": _tool_schema(chosen, by_name[chosen]),
        }
    elif tool_choice == "required" and by_name:
        selected = by_name
        schema = {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "anyOf": [_tool_schema(n, p) for n, p in by_name.items()],
            },
        }
    else:
        return None
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return _lift_defs(schema, selected)
