"""PD router: send each request to a prefill server and a decode server, answer from the decode one.

    python -m sglang.srt.disaggregation.router --pd-disaggregation --prefill http://P:30000 [BOOTSTRAP_PORT]
        --decode http://D:30001 [--decode http://D2:30001 ...] [--host 127.0.0.1 --port 8000]

(upstream's `sglang_router.launch_router` flags; repeat --prefill / --decode for more servers). Each request gets a random `bootstrap_room` and the
prefill server's bootstrap address, then goes to both servers at once (the decode server
preallocates while the prefill runs). The decode server's answer (JSON or SSE stream) is relayed
as is; a prefill error answers the request (the decode side is cancelled). Several servers of each
kind (decode replicas = data parallelism) are used round robin over every (prefill, decode) pair; a
decode server that refuses the connection is skipped for the next one. No reachable decode server
gives a 503, one that dies mid-request a 502, both with an OpenAI-style error body, and the other
side's request is cancelled, which aborts it there and frees its slots.

The client's body is forwarded byte for byte, with only the bootstrap fields appended (JSON's last
duplicate key wins, so ours override any the client sent): the servers validate it and the router
answers with what the server answered (status, body, content type), so bad input gets the
servers' 400, not a router 500 (re-serialising failed on NaN and lone surrogates). A body the
router cannot parse goes unchanged to a decode server, whose parser refuses it the same way.
Unknown routes get OpenAI-shaped 404s; no error drops the keep-alive connection.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import random
from urllib.parse import urlparse

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)
ROUTES = ("/v1/completions", "/v1/chat/completions", "/generate")


def _error(status: int, message: str, err_type: str = "server_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": err_type, "param": None, "code": status}}, status)


class PDRouter:
    def __init__(self, prefill: list[tuple[str, int | None]], decode: list[str], timeout: float = 600.0) -> None:
        self.prefill_urls = [u.rstrip("/") for u, _ in prefill]
        self.bootstrap_ports = [p for _, p in prefill]
        self.decode_urls = [u.rstrip("/") for u in decode]
        self._rr = itertools.count()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0))

    async def resolve_bootstrap_ports(self) -> None:
        """Ask each prefill server for its --disaggregation-bootstrap-port where not given."""
        for i, url in enumerate(self.prefill_urls):
            info = (await self.client.get(url + "/get_server_info")).json()
            if info.get("disaggregation_mode") != "prefill":
                raise RuntimeError(f"{url} is not a prefill server (--disaggregation-mode "
                                   f"{info.get('disaggregation_mode')})")
            if self.bootstrap_ports[i] is None:
                self.bootstrap_ports[i] = int(info["disaggregation_bootstrap_port"])
        for url in self.decode_urls:
            info = (await self.client.get(url + "/get_server_info")).json()
            if info.get("disaggregation_mode") != "decode":
                raise RuntimeError(f"{url} is not a decode server")

    def pick(self) -> tuple[str, list[str], int]:
        """Round robin over every (prefill, decode) pair -- prefill k % P, decode k // P % D -- so each
        server gets its share and each decode server receives from every prefill server. Returns the
        prefill URL, the decode URLs in the order to try (the picked one first) and the bootstrap port."""
        k = next(self._rr)
        i, j = k % len(self.prefill_urls), k // len(self.prefill_urls) % len(self.decode_urls)
        return self.prefill_urls[i], self.decode_urls[j:] + self.decode_urls[:j], self.bootstrap_ports[i]

    async def _send_decode(self, decodes: list[str], path: str, body: bytes, fwd: dict) -> tuple[str, httpx.Response]:
        """Send to the first decode server that accepts the connection. One that refuses never saw the
        request, so the next may take it: the prefill server sends the KV to whichever registers."""
        for url in decodes[:-1]:
            try:
                return url, await self.client.send(self.client.build_request("POST", url + path, content=body,
                                                                             headers=fwd), stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                logger.warning("decode server %s unreachable (%s): trying the next one", url, e)
        url = decodes[-1]
        return url, await self.client.send(self.client.build_request("POST", url + path, content=body,
                                                                     headers=fwd), stream=True)

    async def forward_unparsed(self, path: str, raw: bytes, headers: dict) -> Response:
        """A body the router cannot parse: the decode server's own answer (its parser refuses it)."""
        url = self.decode_urls[next(self._rr) % len(self.decode_urls)]
        try:
            r = await self.client.post(url + path, content=raw, headers=_forwarded(headers))
        except (httpx.HTTPError, OSError) as e:
            return _error(502, f"decode server {url} failed: {type(e).__name__}: {e}")
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    async def handle(self, path: str, raw: bytes, body: dict, headers: dict) -> Response:
        refusal = _unsupported(body)
        if refusal is not None:
            return _error(400, refusal, "invalid_request_error")
        prefill, decodes, bport = self.pick()
        boot = {"bootstrap_host": urlparse(prefill).hostname, "bootstrap_port": bport,
                "bootstrap_room": random.getrandbits(63)}
        fwd = _forwarded(headers)
        pre_extra = {**boot, "stream": False, **({"stream_options": None} if "stream_options" in body else {})}
        pre_task = asyncio.create_task(self.client.post(prefill + path, content=_append_fields(raw, body, pre_extra),
                                                        headers=fwd))
        stream = body.get("stream") is True
        try:
            dec_task = asyncio.create_task(self._send_decode(decodes, path, _append_fields(raw, body, boot), fwd))
            done, _ = await asyncio.wait({pre_task, dec_task}, return_when=asyncio.FIRST_COMPLETED)
            if pre_task in done and dec_task not in done:
                pre_err = _failed(pre_task)
                if pre_err is not None:
                    dec_task.cancel()
                    return pre_err
            decode, resp = await dec_task
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            pre_task.cancel()
            return _error(503, f"no decode server reachable ({', '.join(decodes)}): {type(e).__name__}: {e}")
        except (httpx.HTTPError, OSError) as e:
            pre_task.cancel()
            return _error(502, f"decode server failed: {type(e).__name__}: {e}")
        if not stream or resp.status_code != 200:
            try:
                data = await resp.aread()
            except (httpx.HTTPError, OSError) as e:
                pre_task.cancel()
                return _error(502, f"decode server {decode} failed mid-response: {type(e).__name__}: {e}")
            finally:
                await resp.aclose()
            if resp.status_code != 200:  # the decode side refused it: cancel (abort) the prefill's copy
                pre_task.cancel()
            await _settle(pre_task)
            return Response(data, resp.status_code, media_type=resp.headers.get("content-type"))
        return StreamingResponse(self._relay(resp, pre_task, decode),
                                 media_type=resp.headers.get("content-type", "text/event-stream"))

    async def _relay(self, resp: httpx.Response, pre_task: asyncio.Task, decode: str):
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except (httpx.HTTPError, OSError) as e:
            pre_task.cancel()
            err = {"error": {"message": f"decode server {decode} failed mid-stream: {type(e).__name__}: {e}",
                             "type": "server_error", "param": None, "code": 502}}
            yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await resp.aclose()
            await _settle(pre_task)


def _forwarded(headers: dict) -> dict:
    fwd = {k: v for k, v in headers.items() if k.lower() in ("authorization", "content-type")}
    if not any(k.lower() == "content-type" for k in fwd):
        fwd["content-type"] = "application/json"
    return fwd


def _unsupported(body: dict) -> str | None:
    """Why the router cannot split this (valid-looking) request into one room, or None. Malformed
    fields pass: the servers name them in their 400."""
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        return "n > 1 is not supported by the PD router (one room per request)"
    prompt, ids = body.get("prompt"), body.get("input_ids")
    if (isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))) or isinstance(body.get("text"), list) \
            or (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        return "batched prompts are not supported by the PD router: send one request per prompt"
    return None


def _append_fields(raw: bytes, body: dict, fields: dict) -> bytes:
    """The client's JSON object with `fields` appended before its closing brace; the rest of its
    bytes stay as sent (no re-serialisation: NaN, escapes and numbers reach the server as is)."""
    head = raw.rstrip()
    assert head.endswith(b"}"), "a parsed JSON object ends with '}'"
    extra = json.dumps(fields)[1:-1].encode()
    return head[:-1] + (b"," if body else b"") + extra + b"}"


def _failed(task: asyncio.Task) -> Response | None:
    """The prefill's answer as the request's answer when it is an error (None when it is fine)."""
    try:
        r = task.result()
    except (httpx.HTTPError, OSError) as e:
        return _error(502, f"prefill server failed: {type(e).__name__}: {e}")
    if r.status_code >= 400:
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
    return None


async def _settle(task: asyncio.Task) -> None:
    try:
        await task
    except (asyncio.CancelledError, httpx.HTTPError, OSError):
        pass


def create_app(router: PDRouter) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await router.resolve_bootstrap_ports()
        yield
        await router.client.aclose()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> Response:
        for url in router.prefill_urls + router.decode_urls:
            try:
                r = await router.client.get(url + "/health", timeout=5)
                if r.status_code != 200:
                    return _error(503, f"{url} is not healthy ({r.status_code})")
            except (httpx.HTTPError, OSError) as e:
                return _error(503, f"{url} is unreachable: {e}")
        return Response(status_code=200)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:  # unknown routes, wrong methods
        message = f"{request.method} {request.url.path}: {exc.detail}" if exc.status_code in (404, 405) else exc.detail
        return _error(exc.status_code, str(message), "invalid_request_error")

    @app.get("/v1/models")
    async def models() -> Response:
        for url in router.decode_urls:  # the first decode server that answers
            try:
                r = await router.client.get(url + "/v1/models", timeout=10)
                return Response(r.content, r.status_code, media_type="application/json")
            except (httpx.HTTPError, OSError) as e:
                logger.warning("decode server %s unreachable: %s", url, e)
        return _error(503, "no decode server reachable")

    for path in ROUTES:
        async def route(request: Request, _path: str = path) -> Response:
            try:
                return await _route(request, _path)
            except Exception as e:  # noqa: BLE001 -- answered here: an app-level handler re-raises,
                logger.exception("router error")  # which resets the client's keep-alive connection
                return _error(500, f"router error: {type(e).__name__}: {e}")

        app.add_api_route(path, route, methods=["POST"])

    async def _route(request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError):  # bad UTF-8 / JSON, too deep: the server's parser says why
            body = None
        if not isinstance(body, dict):
            return await router.forward_unparsed(path, raw, dict(request.headers))
        return await router.handle(path, raw, body, dict(request.headers))

    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m sglang.srt.disaggregation.router")
    ap.add_argument("--pd-disaggregation", action="store_true", help="PD mode (the only mode of this router).")
    ap.add_argument("--prefill", nargs="+", action="append", required=True, metavar=("URL", "BOOTSTRAP_PORT"),
                    help="A prefill server, optionally with its bootstrap port (default: asked from the server).")
    ap.add_argument("--decode", action="append", required=True, metavar="URL", help="A decode server.")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    if not args.pd_disaggregation:
        ap.error("--pd-disaggregation is required (this router only routes prefill/decode pairs)")
    for p in args.prefill:
        if len(p) > 2 or (len(p) == 2 and not p[1].isdigit()):
            ap.error(f"--prefill takes URL [BOOTSTRAP_PORT], got {p}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    prefill = [(p[0], int(p[1]) if len(p) == 2 else None) for p in args.prefill]
    router = PDRouter(prefill, args.decode, args.request_timeout)
    uvicorn.run(create_app(router), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
