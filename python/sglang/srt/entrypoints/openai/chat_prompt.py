"""Chat messages -> prompt text: message checks, the model's chat template (or DeepSeek-V3.2's
Python encoder, which that model ships instead of a Jinja template), tools and template kwargs."""

from __future__ import annotations

import copy
import json
from typing import Any

from sglang.srt.managers.tokenizer_manager import RequestError

ROLES = {"system", "developer", "user", "assistant", "tool"}
# Architectures whose checkpoints ship a Python prompt encoder instead of a Jinja chat template.
DSV32_ARCHS = {"DeepseekV32ForCausalLM"}


def _text_content(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        kind = part.get("type")
        if kind != "text":
            raise RequestError(f"messages[{i}]: content part type {kind!r} is not supported (text only)",
                               param="messages")
        parts.append(part.get("text", ""))
    return "".join(parts)


def messages_for_template(messages: list, tool_args_as_dict: bool = True) -> list[dict]:
    """Validated plain dicts for a template: text content, `developer` as `system`, assistant
    tool calls (arguments parsed from their JSON string when `tool_args_as_dict`), tool results."""
    if not messages:
        raise RequestError("messages must not be empty", param="messages")
    out = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise RequestError(f"messages[{i}].role {m.role!r} is not one of {sorted(ROLES)}", param="messages")
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": _text_content(m.content, i)}
        if m.name is not None:
            msg["name"] = m.name
        if m.role == "tool":
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            if m.role != "assistant":
                raise RequestError(f"messages[{i}]: only assistant messages carry tool_calls", param="messages")
            calls = []
            for j, tc in enumerate(m.tool_calls):
                args = tc.function.arguments
                if tool_args_as_dict and isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        raise RequestError(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON",
                                           param="messages") from None
                elif not tool_args_as_dict and not isinstance(args, str):
                    args = json.dumps(args or {}, ensure_ascii=False)
                calls.append({"id": tc.id, "type": "function",
                              "function": {"name": tc.function.name, "arguments": args}})
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def render_prompt(tokenizer, architecture: str | None, messages: list, tools: list[dict] | None,
                  template_kwargs: dict[str, Any], continue_final_message: bool = False) -> str:
    """The prompt text for `messages` (pydantic ChatMessage objects). Errors are 400s."""
    if continue_final_message and (not messages or messages[-1].role != "assistant"):
        raise RequestError("continue_final_message needs the last message to be an assistant message",
                           param="continue_final_message")
    if getattr(tokenizer, "chat_template", None) is None and architecture in DSV32_ARCHS:
        return _render_dsv32(messages, tools, template_kwargs, continue_final_message)
    if getattr(tokenizer, "chat_template", None) is None:
        raise RequestError("this model has no chat template; start the server with --chat-template FILE or use "
                           "/v1/completions", param="messages")
    kwargs = dict(template_kwargs)
    for reserved in ("messages", "tools", "tokenize", "add_generation_prompt", "continue_final_message"):
        if reserved in kwargs:
            raise RequestError(f"chat_template_kwargs must not set {reserved!r}", param="chat_template_kwargs")
    last_error: Exception | None = None
    # Templates differ on tool-call arguments: GLM's iterate a dict, DeepSeek-V3.1's concatenate
    # the JSON string. Try the dict form first, then the string form.
    for as_dict in (True, False):
        msgs = messages_for_template(messages, tool_args_as_dict=as_dict)
        try:
            return tokenizer.apply_chat_template(
                msgs, tools=copy.deepcopy(tools) if tools else None, tokenize=False,
                add_generation_prompt=not continue_final_message, continue_final_message=continue_final_message,
                **kwargs)
        except RequestError:
            raise
        except Exception as e:  # the template's own checks (raise_exception) or a type error
            last_error = e
            if not any(m.tool_calls for m in messages):
                break
    raise RequestError(f"cannot apply the chat template: {last_error}", param="messages")


def _render_dsv32(messages: list, tools: list[dict] | None, template_kwargs: dict[str, Any],
                  continue_final_message: bool) -> str:
    from sglang.srt.entrypoints.openai.encoding_dsv32 import encode_messages

    if continue_final_message:
        raise RequestError("continue_final_message is not supported with DeepSeek-V3.2's prompt encoder",
                           param="continue_final_message")
    mode = "thinking" if template_kwargs.get("thinking") else "chat"
    try:
        return encode_messages(messages_for_template(messages), thinking_mode=mode, tools=tools)
    except (ValueError, KeyError, TypeError) as e:  # DS32EncodingError is a ValueError
        raise RequestError(f"cannot encode the messages: {e}", param="messages") from None

