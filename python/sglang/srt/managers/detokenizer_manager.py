"""Incremental detokenization (per request state); the detokenizer process wraps it.

Text is emitted only once it is final: bytes of an incomplete UTF-8 character are held back
(the tokenizer decodes them as U+FFFD), and so is any tail that could be the start of a stop
string. On finish, a matched stop string (and text after it) or a matched stop token is
trimmed unless `no_stop_trim`.
"""

from __future__ import annotations

from typing import Callable


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

    def push(self, new_ids: list[int], finished_reason: dict | None = None) -> str:
        """Add tokens; returns the newly final text."""
        return push_batch([self], [new_ids], [finished_reason])[0]

    # push = _add (ids, decode windows) -> decode (batched across requests) -> _apply
    def _add(self, new_ids: list[int], finished_reason: dict | None) -> tuple[list[int], list[int]]:
        ids = list(new_ids)
        if (finished_reason is not None and not self.no_stop_trim
                and isinstance(finished_reason.get("matched"), int) and ids):
            ids = ids[:-1]  # the matched stop token is not part of the text
        self.ids.extend(ids)
        return self.ids[self.surr_offset :], self.ids[self.surr_offset : self.read_offset]

    def _apply(self, new: str, surr: str, finished_reason: dict | None) -> str:
        finished = finished_reason is not None
        if finished or not new.endswith("\ufffd"):
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


def push_batch(states: list[DecodeState], new_ids: list[list[int]], finished: list[dict | None]) -> list[str]:
    """DecodeState.push for many requests with one batched tokenizer call per decode option set
    (per-request decode calls dominated the host time of large decode batches)."""
    if len({id(st) for st in states}) != len(states):  # one request twice in a batch: keep their order
        return [push_batch([st], [ids], [fin])[0] for st, ids, fin in zip(states, new_ids, finished)]
    windows = [st._add(ids, fin) for st, ids, fin in zip(states, new_ids, finished)]
    texts: list[tuple[str, str] | None] = [None] * len(states)
    groups: dict[tuple, list[int]] = {}
    for i, st in enumerate(states):
        groups.setdefault((id(st.tokenizer), st.skip_special_tokens, st.spaces_between_special_tokens), []).append(i)
    for idx in groups.values():
        st = states[idx[0]]
        flat = [windows[i][0] for i in idx] + [windows[i][1] for i in idx]
        decoded = st.tokenizer.batch_decode(flat, skip_special_tokens=st.skip_special_tokens,
                                            spaces_between_special_tokens=st.spaces_between_special_tokens)
        for j, i in enumerate(idx):
            texts[i] = (decoded[j], decoded[len(idx) + j])
    return [st._apply(new, surr, fin) for st, (new, surr), fin in zip(states, texts, finished)]


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

        states = []
        for out in batch.outputs:
            state = self.states.get(out.rid)
            if state is None:
                state = self.states[out.rid] = DecodeState(
                    self.tokenizer, out.skip_special_tokens, out.spaces_between_special_tokens, out.stop_strs,
                    out.no_stop_trim)
            states.append(state)
        deltas = push_batch(states, [o.new_token_ids for o in batch.outputs],
                            [o.finished_reason for o in batch.outputs])
        for out in batch.outputs:
            if out.finished_reason is not None:
                self.states.pop(out.rid, None)
        return BatchStrOut([StrOutput(d, o) for d, o in zip(deltas, batch.outputs)])

    def event_loop(self, stop: Callable[[], bool] = lambda: False) -> None:
        """Serve until `stop()` (never, in the detokenizer process; in-process test servers stop)."""
        while not stop():
            if self.recv_from_scheduler.poll(1000):
                self.send_to_tokenizer.send_pyobj(self.handle(self.recv_from_scheduler.recv_pyobj()))


def run_detokenizer_process(server_args, port_args) -> None:
    import logging
    import os
    import traceback

    from sglang.srt.utils.common import configure_logger
    from sglang.srt.utils.ipc import kill_itself_when_parent_died, stop_event_on_sigterm

    kill_itself_when_parent_died()
    stopping = stop_event_on_sigterm()
    configure_logger(server_args.log_level, prefix=" detokenizer")
    try:
        DetokenizerManager(server_args, port_args).event_loop(stop=stopping.is_set)
    except BaseException:
        logging.getLogger(__name__).error("detokenizer crashed:\n%s", traceback.format_exc())
        os._exit(1)
    logging.getLogger(__name__).info("detokenizer stopped")
