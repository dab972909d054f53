"""DeepSeek-V3.2 prompt encoding (the model ships a Python encoder instead of a Jinja template).

Our implementation of the format documented by `encoding/encoding_dsv32.py` in the
deepseek-ai/DeepSeek-V3.2 HF repo (also mirrored by upstream SGLang and vLLM):

    BOS  system [+ "\\n\\n" + tools prompt] [+ "\\n\\n" + response format]
         "<｜User｜>" user "<｜Assistant｜>" + ("<think>" if thinking and last user turn else "</think>")
         [reasoning + "</think>", only thinking mode after the last user turn] content
         ["\\n\\n" + DSML function_calls block] "<｜end▁of▁sentence｜>"
         tool results: "\\n\\n<function_results>" + "\\n<result>...</result>" per call
                       + "\\n</function_results>" + "\\n\\n" + ("<think>" | "</think>")

Reasoning of turns before the last user message is never rendered ("drop thinking").
The tool-call block is what `deepseekv32` (function_call/deepseekv32_detector.py) parses.
"""

from __future__ import annotations

import json
from typing import Any

bos_token = "<｜begin▁of▁sentence｜>"
eos_token = "<｜end▁of▁sentence｜>"
user_token = "<｜User｜>"
assistant_token = "<｜Assistant｜>"
thinking_start_token = "<think>"
thinking_end_token = "</think>"
dsml_token = "｜DSML｜"

# The tools prompt the model was trained on; wording, newlines and placeholders are load-bearing.
TOOLS_SYSTEM_TEMPLATE = """## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{dsml_token}function_calls>" block like the following as part of your reply to the user:
<{dsml_token}function_calls>
<{dsml_token}invoke name="$FUNCTION_NAME">
<{dsml_token}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml_token}parameter>
...
</{dsml_token}invoke>
<{dsml_token}invoke name="$FUNCTION_NAME2">
...
</{dsml_token}invoke>
</{dsml_token}function_calls>
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:
<{dsml_token}function_calls>
...
</{dsml_token}function_calls>
<function_results>
...
</function_results>
{thinking_start_token}...thinking about results{thinking_end_token}
Here are the functions available in JSONSchema format:
<functions>
{tool_schemas}
</functions>
"""

RESPONSE_FORMAT_TEMPLATE = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"
)


class DS32EncodingError(ValueError):
    """Messages that the V3.2 format cannot express (the server answers 400)."""


def _to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _text(content: Any) -> str:
    # OpenAI content may be a list of parts; the format only carries text.
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def render_tools(tools: list[dict[str, Any]]) -> str:
    """Tools prompt; `tools` are OpenAI tool dicts, rendered as their `function` objects."""
    schemas = "\n".join(_to_json(t.get("function", t)) for t in tools)
    return TOOLS_SYSTEM_TEMPLATE.format(
        dsml_token=dsml_token,
        thinking_start_token=thinking_start_token,
        thinking_end_token=thinking_end_token,
        tool_schemas=schemas,
    )


def encode_arguments_to_dsml(arguments: str | dict[str, Any]) -> str:
    """`<parameter>` lines of one call: strings raw with string="true", all else JSON."""
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    if not isinstance(args, dict):
        raise DS32EncodingError("Assistant tool call function.arguments must be a JSON object.")
    return "\n".join(
        f'<{dsml_token}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
        f"{v if isinstance(v, str) else _to_json(v)}</{dsml_token}parameter>"
        for k, v in args.items()
    )


def render_tool_calls(tool_calls: list[dict[str, Any]]) -> str:
    """The DSML block of an assistant turn (OpenAI `tool_calls` entries)."""
    invokes = []
    for call in tool_calls:
        fn = call.get("function", call)
        invokes.append(
            f'<{dsml_token}invoke name="{fn.get("name")}">\n'
            f"{encode_arguments_to_dsml(fn.get('arguments') or {})}\n</{dsml_token}invoke>"
        )
    return f"<{dsml_token}function_calls>\n" + "\n".join(invokes) + f"\n</{dsml_token}function_calls>"


def _last_user_index(messages: list[dict[str, Any]]) -> int:
    for idx in range(len(messages) - 1, -1, -1):
        if messages[idx].get("role") in ("user", "developer"):
            return idx
    return -1


def _render(index: int, messages: list[dict[str, Any]], thinking: bool) -> str:
    msg = messages[index]
    role = msg.get("role")
    content = _text(msg.get("content"))
    last_user = _last_user_index(messages)
    # After the last user turn in thinking mode the assistant opens a thinking block.
    open_block = thinking_start_token if thinking and index >= last_user else thinking_end_token

    if role == "system":
        out = content
        if msg.get("tools"):
            out += "\n\n" + render_tools(msg["tools"])
        if msg.get("response_format"):
            out += "\n\n" + RESPONSE_FORMAT_TEMPLATE.format(schema=_to_json(msg["response_format"]))
        return out

    if role in ("user", "developer"):
        if role == "developer":
            if not content:
                raise DS32EncodingError(f"Invalid message for role 'developer': {msg}")
            body = ""
            if msg.get("tools"):
                body += "\n\n" + render_tools(msg["tools"])
            if msg.get("response_format"):
                body += "\n\n" + RESPONSE_FORMAT_TEMPLATE.format(schema=_to_json(msg["response_format"]))
            content = body + f"\n\n# The user's message is: {content}"
        return f"{user_token}{content}{assistant_token}" + (
            thinking_start_token if thinking and index == last_user else thinking_end_token
        )

    if role == "tool":
        prev = index - 1
        while prev >= 0 and messages[prev].get("role") == "tool":
            prev -= 1
        calls = messages[prev].get("tool_calls") if prev >= 0 else None
        if prev < 0 or messages[prev].get("role") != "assistant" or not calls:
            raise DS32EncodingError(f"Tool message at {index} does not follow an assistant tool call")
        order = index - prev  # 1-based position among this assistant turn's results
        if order > len(calls):
            raise DS32EncodingError(f"More tool results than tool calls at message {index}")
        out = "\n\n<function_results>" if order == 1 else ""
        out += f"\n<result>{content}</result>"
        if order == len(calls):
            out += "\n</function_results>\n\n" + open_block
        return out

    if role == "assistant":
        reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
        tool_calls = msg.get("tool_calls") or []
        thinking_part = ""
        if thinking and index > last_user:
            if not (reasoning or tool_calls):
                raise DS32EncodingError(
                    f"Thinking mode: assistant message {index} after the last user message "
                    "needs reasoning_content or tool_calls"
                )
            thinking_part = reasoning + thinking_end_token
        calls_part = "\n\n" + render_tool_calls(tool_calls) if tool_calls else ""
        return f"{thinking_part}{content}{calls_part}{eos_token}"

    raise DS32EncodingError(f"Unknown role: {role!r}")


def encode_messages(
    messages: list[dict[str, Any]],
    thinking_mode: str = "chat",
    tools: list[dict[str, Any]] | None = None,
    context: list[dict[str, Any]] | None = None,
    drop_thinking: bool = True,
    add_default_bos_token: bool = True,
) -> str:
    """Prompt string for `messages` (OpenAI chat dicts), ending with the generation prompt.

    thinking_mode: "chat" or "thinking". `tools` (OpenAI tool dicts) go into the first system
    message, one with empty content being inserted if there is none (upstream serving does the
    same). `context`: earlier messages already in the KV cache; they shape the rendering but
    are not emitted (and no BOS is added). `drop_thinking` is accepted for signature
    compatibility: V3.2 never renders reasoning before the last user turn either way.
    """
    del drop_thinking
    if thinking_mode not in ("chat", "thinking"):
        raise DS32EncodingError(f"Invalid thinking_mode {thinking_mode!r}; use 'chat' or 'thinking'")
    messages = [dict(m) for m in messages]
    if tools:
        if not messages or messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": ""})
        messages[0]["tools"] = tools
    context = list(context or [])
    full = context + messages
    prompt = bos_token if add_default_bos_token and not context else ""
    thinking = thinking_mode == "thinking"
    for idx in range(len(context), len(full)):
        prompt += _render(idx, full, thinking)
    return prompt
