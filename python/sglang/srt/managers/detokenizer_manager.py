"""Incremental detokenization (per request state); the detokenizer process wraps it.

Text is emitted only once it is final: bytes of an incomplete UTF-8 character are held back
(the tokenizer decodes them as U+FFFD), and so is any tail that could be the start of a stop
string. On finish, a matched stop string (and text after it) or a matched stop token is
trimmed unless `no_stop_trim`.
"""

from __future__ import annotations


def _stop_holdback(text: str, stop_strs: list[str]) -> int:
    """Chars at the end of `text` that could begin a stop string."""
    hold = 0
    for s in stop_strs:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold


class DecodeState:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                 stop_strs: list[str] | None = None, no_stop_trim: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop_strs = [s for s in (stop_strs or []) if s]
        self.no_stop_trim = no_stop_trim
        self.ids: list[int] = []
        self.surr_offset = 0
        self.read_offset = 0
        self.text = ""
        self.sent = 0

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens)

    def push(self, new_ids: list[int], finished_reason: dict | None = None) -> str:
        """Add tokens; returns the newly final text."""
        finished = finished_reason is not None
        ids = list(new_ids)
        if finished and not self.no_stop_trim and isinstance((finished_reason or {}).get("matched"), int) and ids:
            ids = ids[:-1]  # the matched stop token is not part of the text
        self.ids.extend(ids)
        new = self._decode(self.ids[self.surr_offset :])
        if finished or not new.endswith("\ufffd"):
            surr = self._decode(self.ids[self.surr_offset : self.read_offset])
            self.text += new[len(surr) :]
            self.surr_offset, self.read_offset = self.read_offset, len(self.ids)
        end = len(self.text)
        if finished:
            matched = (finished_reason or {}).get("matched")
            if isinstance(matched, str) and matched and not self.no_stop_trim:
                cut = self.text.find(matched, max(self.sent - len(matched), 0))
                if cut < 0:
                    cut = self.text.find(matched)
                if cut >= 0:
                    self.text = self.text[: max(cut, self.sent)]
                    end = len(self.text)
        else:
            end -= _stop_holdback(self.text[self.sent :], self.stop_strs)
        delta = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return delta


class DetokenizerManager:
    """The detokenizer process: token deltas in, text deltas out."""

    def __init__(self, server_args, port_args) -> None:
        import zmq

        from sglang.srt.managers.tokenizer_utils import load_tokenizer
        from sglang.srt.utils.ipc import get_zmq_socket

        self.tokenizer = load_tokenizer(server_args.tokenizer_path, server_args.trust_remote_code)
        ctx = zmq.Context(2)
        self.recv_from_scheduler = get_zmq_socket(ctx, zmq.PULL, port_args.detokenizer_ipc_name, True)
        self.send_to_tokenizer = get_zmq_socket(ctx, zmq.PUSH, port_args.tokenizer_ipc_name, False)
        self.states: dict[str, DecodeState] = {}

    def handle(self, batch) -> "object":
        from sglang.srt.managers.io_struct import BatchStrOut, StrOutput

        outs = []
        for out in batch.outputs:
            state = self.states.get(out.rid)
            if state is None:
                state = self.states[out.rid] = DecodeState(
                    self.tokenizer, out.skip_special_tokens, out.spaces_between_special_tokens, out.stop_strs,
                    out.no_stop_trim)
            delta = state.push(out.new_token_ids, out.finished_reason)
            if out.finished_reason is not None:
                del self.states[out.rid]
            outs.append(StrOutput(delta, out))
        return BatchStrOut(outs)

    def event_loop(self) -> None:
        while True:
            self.send_to_tokenizer.send_pyobj(self.handle(self.recv_from_scheduler.recv_pyobj()))


def run_detokenizer_process(server_args, port_args) -> None:
    import logging
    import os
    import traceback

    from sglang.srt.utils.common import configure_logger
    from sglang.srt.utils.ipc import kill_itself_when_parent_died

    kill_itself_when_parent_died()
    configure_logger(server_args.log_level, prefix=" detokenizer")
    try:
        DetokenizerManager(server_args, port_args).event_loop()
    except BaseException:
        logging.getLogger(__name__).error("detokenizer crashed:\n%s", traceback.format_exc())
        os._exit(1)
