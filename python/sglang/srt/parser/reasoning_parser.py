"""Split model output into reasoning (`<think>...</think>`) and normal text.

Public names follow upstream SGLang (`ReasoningParser`, `DetectorMap`, `parse_non_stream`,
`parse_stream_chunk`) so its users find their way. The rules, identical in both modes:

* A reasoning block is open from the start of the output when `force_reasoning` is set (the
  chat template already ended the prompt with `<think>`), or when the output itself starts with
  the think-start token (leading whitespace allowed). A think-start token the model echoes at
  the very start of a forced block is dropped.
* The block ends at the think-end token (dropped) or, for formats with a `tool_start_token`,
  where a tool call starts (kept in the normal text for the tool-call parser).
* Unterminated reasoning (max_tokens) is all reasoning.
* Both parts are `.strip()`-ed; empty parts are returned as None.

Per request, build the parser with `make_reasoning_parser(name, chat_template_kwargs)`: it
reads the thinking switch (`reasoning_enabled`) and forces the block where the prompt opened it.

Streaming: the concatenation of the deltas of `parse_stream_chunk` (plus `parse_stream_end`,
needed only with `stream_reasoning=False` or when the text is cut inside a marker) equals
`parse_non_stream` of the whole text, for every way of cutting the text into chunks. Both
modes run the same state machine, which decides only on content it has fully seen.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.parser.stream_utils import StripStream, partial_suffix_len


class StreamingParseResult:
    """Deltas of one parse step (empty string = nothing)."""

    def __init__(self, normal_text: str = "", reasoning_text: str = "") -> None:
        self.normal_text = normal_text
        self.reasoning_text = reasoning_text


class BaseReasoningFormatDetector:
    """State machine: START -> (REASONING ->) NORMAL.

    Class attributes describe the format and how a request switches thinking on:
    `thinking_kwarg` is the `chat_template_kwargs` key (None = always thinks) and
    `thinking_default` its value when the request does not set it.
    """

    think_start_token = "<think>"
    think_end_token = "</think>"
    tool_start_token: str | None = None
    thinking_kwarg: str | None = "enable_thinking"
    thinking_default = True
    default_force_reasoning = False
    # True when a thinking request's generation prompt itself ends with the think-start token,
    # so the output begins inside the block (see `make_reasoning_parser`).
    prompt_opens_block = False

    _START, _REASONING, _NORMAL = "start", "reasoning", "normal"

    def __init__(self, stream_reasoning: bool = True, force_reasoning: bool | None = None) -> None:
        self.stream_reasoning = stream_reasoning
        self.force_reasoning = (
            self.default_force_reasoning if force_reasoning is None else force_reasoning
        )
        self._state = self._START
        self._buffer = ""
        self._reasoning_out = StripStream()
        self._normal_out = StripStream()
        self._held_reasoning = ""  # stream_reasoning=False: released when the block ends

    # -- one state machine for both modes -------------------------------------------------
    def _step(self, final: bool) -> tuple[str, str]:
        """Consume as much of the buffer as can be decided; return raw (reasoning, normal)."""
        reasoning, normal = [], []
        while True:
            buf = self._buffer
            if self._state == self._START:
                lead = buf.lstrip()
                if lead.startswith(self.think_start_token):
                    self._buffer = lead[len(self.think_start_token):]
                    self._state = self._REASONING
                    continue
                if not final and self.think_start_token.startswith(lead):
                    return "".join(reasoning), "".join(normal)  # may still become <think>
                self._state = self._REASONING if self.force_reasoning else self._NORMAL
                continue
            if self._state == self._REASONING:
                ends = [(buf.find(self.think_end_token), self.think_end_token, True)]
                if self.tool_start_token:
                    ends.append((buf.find(self.tool_start_token), self.tool_start_token, False))
                found = [e for e in ends if e[0] != -1]
                if found:
                    idx, token, drop = min(found, key=lambda e: e[0])
                    reasoning.append(buf[:idx])
                    self._buffer = buf[idx + len(token):] if drop else buf[idx:]
                    self._state = self._NORMAL
                    continue
                keep = 0 if final else partial_suffix_len(buf, [e[1] for e in ends])
                reasoning.append(buf[: len(buf) - keep])
                self._buffer = buf[len(buf) - keep:]
                return "".join(reasoning), "".join(normal)
            normal.append(buf)
            self._buffer = ""
            return "".join(reasoning), "".join(normal)

    def _emit(self, raw_reasoning: str, raw_normal: str, final: bool) -> StreamingParseResult:
        reasoning = self._reasoning_out.feed(raw_reasoning)
        if not self.stream_reasoning:
            self._held_reasoning += reasoning
            reasoning = ""
            if self._state == self._NORMAL or final:
                reasoning, self._held_reasoning = self._held_reasoning, ""
        return StreamingParseResult(
            normal_text=self._normal_out.feed(raw_normal), reasoning_text=reasoning
        )

    def parse_streaming_increment(self, new_text: str) -> StreamingParseResult:
        self._buffer += new_text
        return self._emit(*self._step(final=False), final=False)

    def finish(self) -> StreamingParseResult:
        """Flush at end of stream: a held-back partial marker is plain text after all."""
        return self._emit(*self._step(final=True), final=True)

    def detect_and_parse(self, text: str) -> StreamingParseResult:
        fresh = type(self)(stream_reasoning=True, force_reasoning=self.force_reasoning)
        first = fresh.parse_streaming_increment(text)
        last = fresh.finish()
        return StreamingParseResult(
            normal_text=first.normal_text + last.normal_text,
            reasoning_text=first.reasoning_text + last.reasoning_text,
        )


class DeepSeekR1Detector(BaseReasoningFormatDetector):
    """DeepSeek-R1: always reasons; R1 omits `<think>`, R1-0528 echoes it."""

    thinking_kwarg = None
    default_force_reasoning = True
    prompt_opens_block = True


class DeepSeekV3Detector(BaseReasoningFormatDetector):
    """DeepSeek-V3.1 / V3.2: thinking only with `chat_template_kwargs={"thinking": True}`.

    In thinking mode the prompt ends with `<think>`, so construct with `force_reasoning=True`
    (`make_reasoning_parser` does). Tool calls come after `</think>`, so there is no tool start token.
    """

    thinking_kwarg = "thinking"
    thinking_default = False
    prompt_opens_block = True


class Qwen3Detector(BaseReasoningFormatDetector):
    """Qwen3: `enable_thinking` (default on); a `<tool_call>` also closes reasoning."""

    tool_start_token = "<tool_call>"


class Glm45Detector(BaseReasoningFormatDetector):
    """GLM-4.5/4.6/4.7/GLM-5: `enable_thinking` (default on); `<tool_call>` closes reasoning.

    GLM-4.5 emits `<think>` itself; GLM-4.7/5 end the generation prompt with `<think>` (thinking)
    or `</think>` (not), so a thinking request is forced (`make_reasoning_parser`); an echoed
    `<think>` at the start is dropped either way.
    """

    tool_start_token = "<tool_call>"
    prompt_opens_block = True


class KimiDetector(BaseReasoningFormatDetector):
    """Kimi (k1.5 / VL thinking): `◁think▷...◁/think▷`, always on."""

    think_start_token = "◁think▷"
    think_end_token = "◁/think▷"
    thinking_kwarg = None


class ReasoningParser:
    """Reasoning/normal splitter selected by `--reasoning-parser` name."""

    DetectorMap: dict[str, type[BaseReasoningFormatDetector]] = {
        "deepseek-r1": DeepSeekR1Detector,
        "deepseek-v3": DeepSeekV3Detector,
        "glm45": Glm45Detector,
        "qwen3": Qwen3Detector,
        "kimi": KimiDetector,
    }

    def __init__(
        self,
        model_type: str,
        stream_reasoning: bool = True,
        force_reasoning: bool | None = None,
    ) -> None:
        self.detector = _detector_class(model_type)(
            stream_reasoning=stream_reasoning, force_reasoning=force_reasoning
        )

    def parse_non_stream(self, full_text: str) -> tuple[str | None, str | None]:
        """Returns (reasoning_text, normal_text); None for an empty part."""
        ret = self.detector.detect_and_parse(full_text)
        return ret.reasoning_text or None, ret.normal_text or None

    def parse_stream_chunk(self, chunk_text: str) -> tuple[str | None, str | None]:
        """Returns the (reasoning, normal) deltas of this chunk; None for nothing new."""
        ret = self.detector.parse_streaming_increment(chunk_text)
        return ret.reasoning_text or None, ret.normal_text or None

    def parse_stream_end(self) -> tuple[str | None, str | None]:
        """Call once when the stream ends: flushes held-back text (see module docstring)."""
        ret = self.detector.finish()
        return ret.reasoning_text or None, ret.normal_text or None


def _detector_class(parser_name: str) -> type[BaseReasoningFormatDetector]:
    detector_class = ReasoningParser.DetectorMap.get((parser_name or "").lower())
    if detector_class is None:
        raise ValueError(
            f"Unsupported reasoning parser {parser_name!r}; "
            f"valid names: {', '.join(sorted(ReasoningParser.DetectorMap))}"
        )
    return detector_class


def reasoning_enabled(parser_name: str, chat_template_kwargs: dict[str, Any] | None) -> bool:
    """Whether a request asks the model to think, in upstream's per-parser semantics.

    deepseek-v3 reads `thinking` (default False); glm45 / qwen3 read `enable_thinking`
    (default True); deepseek-r1 / kimi always think. The server passes the result as
    `make_reasoning_parser` turns it into the right `force_reasoning`.
    """
    detector_class = _detector_class(parser_name)
    if detector_class.thinking_kwarg is None:
        return True
    value = (chat_template_kwargs or {}).get(detector_class.thinking_kwarg)
    return detector_class.thinking_default if value is None else bool(value)


def think_end_token(parser_name: str) -> str:
    """The marker that closes this parser's reasoning block (`</think>`, Kimi's `◁/think▷`)."""
    return _detector_class(parser_name).think_end_token


def make_reasoning_parser(
    parser_name: str,
    chat_template_kwargs: dict[str, Any] | None,
    stream_reasoning: bool = True,
) -> ReasoningParser:
    """The parser for one request: forced into the reasoning block when the request thinks and
    this model's generation prompt already opened the block (deepseek-r1, deepseek-v3, glm45);
    otherwise the block is recognised by its start token in the output (qwen3, kimi)."""
    force = _detector_class(parser_name).prompt_opens_block and reasoning_enabled(
        parser_name, chat_template_kwargs
    )
    return ReasoningParser(parser_name, stream_reasoning=stream_reasoning, force_reasoning=force)
