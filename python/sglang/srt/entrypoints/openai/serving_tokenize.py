"""/v1/tokenize and /v1/detokenize (upstream SGLang's shapes; no scheduler round trip).

Tokenize: `prompt` (a string -> {tokens: [int], count: int}; a list -> lists of each) or chat
`messages` (rendered with the chat template and encoded exactly as /v1/chat/completions encodes its
prompt, so `count` is that request's prompt_tokens); `max_model_len` is the server's context length.
Detokenize: `tokens` ([int] -> {text: str}; [[int]] -> {text: [str]}); an id outside the model's
vocabulary is a 400 naming `tokens`, never a 500 or a silently empty string.
"""

from __future__ import annotations

from sglang.srt.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from sglang.srt.entrypoints.openai.chat_prompt import render_prompt
from sglang.srt.entrypoints.openai.utils import check_model
from sglang.srt.managers.tokenizer_manager import RequestError, TokenizerManager


class OpenAIServingTokenize:
    def __init__(self, tm: TokenizerManager, served_model_name: str) -> None:
        self.tm, self.served_model_name = tm, served_model_name

    async def handle(self, req: TokenizeRequest) -> dict:
        check_model(self.served_model_name, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise RequestError("exactly one of prompt or messages is required", param="prompt")
        return (await self.tm.run_in_pool(self._tokenize, req)).model_dump()

    def _tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        tok, n_max = self.tm.tokenizer, self.tm.context_len
        if req.messages is not None:
            chat = req.chat_request()
            text = render_prompt(tok, self.tm.scheduler_info.get("architecture"), chat.messages, chat.template_tools(),
                                 chat.template_kwargs(), chat.continue_final_message)
            ids = tok.encode(text, add_special_tokens=False)  # the template carries its own specials
            return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=n_max)
        if isinstance(req.prompt, str):
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
            return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=n_max)
        lists = [tok.encode(p, add_special_tokens=req.add_special_tokens) for p in req.prompt]
        return TokenizeResponse(tokens=lists, count=[len(x) for x in lists], max_model_len=n_max)


class OpenAIServingDetokenize:
    def __init__(self, tm: TokenizerManager, served_model_name: str) -> None:
        self.tm, self.served_model_name = tm, served_model_name

    async def handle(self, req: DetokenizeRequest) -> dict:
        check_model(self.served_model_name, req.model)
        single = not req.tokens or isinstance(req.tokens[0], int)
        lists = [req.tokens] if single else req.tokens
        vocab = self.tm.vocab_size
        for i, ids in enumerate(lists):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                where = "tokens" if single else f"tokens[{i}]"
                raise RequestError(f"{where} holds {bad}, which is not a token id in [0, {vocab})", param="tokens")
        texts = await self.tm.run_in_pool(self._decode, lists, req.skip_special_tokens)
        return DetokenizeResponse(text=texts[0] if single else texts).model_dump()

    def _decode(self, lists: list[list[int]], skip_special_tokens: bool) -> list[str]:
        try:
            return [self.tm.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) for ids in lists]
        except Exception as e:  # an id the model has but the tokenizer lacks (vocab padding)
            raise RequestError(f"cannot decode tokens: {e}", param="tokens") from None
