"""The OpenAI-compatible HTTP API, served beside the chat page on the same host and port:

    GET  /v1/models               the loaded model
    POST /v1/chat/completions     one answer, as JSON or streamed as server-sent events

It speaks to the same service as the page (`service.reply(...)` yields `ReplyEvent`s) and adds
Aerie's speculation statistics in an "aerie" field; a request's own "aerie" field may pick the
drafter (app/api_request.py). Errors come back in OpenAI's shape,
{"error": {"message", "type", "param", "code"}}. It knows nothing about torch or tokens.

launch.py hands the routes to Gradio's FastAPI app:
    demo.launch(..., app_kwargs={"routes": api_routes(service, api_key)})
"""

import asyncio
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.routing import BaseRoute

from app.api_request import ApiError, CompletionRequest, parse_request
from core.config import ReplyEvent, ReplyStats, SamplingConfig
from core.errors import AerieError, ContextOverflowError, StrategyUnavailableError
from core.service.contract import ChatServiceApi

log = logging.getLogger(__name__)

# Aerie's finish reasons in OpenAI's words; "cancelled" only reaches a client that is still there
# when the server stops the answer.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}
_DONE = object()  # the producer thread's last item
# A streamed answer's chunks come at most this often (the service merges the rounds between: core/text.py
# `coalesced`), ~7 tokens each at 150 tokens/s. One chunk a round woke three threads a round (the
# service's reader, the event loop, the socket write) beside the engine's.
STREAM_EVERY_S = 0.05


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def aerie_error(exc: AerieError) -> ApiError:
    """A failure of the service in OpenAI's shape: a prompt too long is the client's to fix."""
    if isinstance(exc, ContextOverflowError):
        return ApiError(400, exc.advice("max_tokens"), param="messages", code="context_length_exceeded")
    if isinstance(exc, StrategyUnavailableError):
        return ApiError(400, str(exc), param="aerie.strategy")
    return ApiError(500, str(exc) or type(exc).__name__, type="server_error")


def unexpected_error(exc: Exception) -> ApiError:
    log.error("Unexpected error while answering an API request", exc_info=exc)
    return ApiError(500, f"Unexpected {type(exc).__name__}; the details are in Aerie's console.", type="server_error")


def check_key(request: Request, api_key: str | None) -> ApiError | None:
    """With a key set, every request must carry `Authorization: Bearer KEY`."""
    if api_key is None:
        return None
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    # compare_digest: the time taken must not tell how much of a guessed key was right
    if scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(), api_key.encode()):
        return None
    return ApiError(401, "Missing or wrong API key: send 'Authorization: Bearer KEY' with the key Aerie was started with.",
                    type="authentication_error", code="invalid_api_key")


def check_json(request: Request) -> ApiError | None:
    """A completion's body must be declared JSON. A browser sends text/plain or a form from any
    site without asking first (a CORS "simple request"); refusing them keeps other sites' pages
    from making the model work."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json")):
        return None
    given = f"not {kind!r}" if kind else "it had no Content-Type"
    return ApiError(415, f"The body must be sent with 'Content-Type: application/json' ({given}).",
                    param="content-type", code="unsupported_media_type")


async def reply_events(service: ChatServiceApi, req: CompletionRequest, cancel: threading.Event) -> AsyncIterator[ReplyEvent]:
    """The service's events, produced in a thread of their own so the server stays responsive.
    Leaving this generator early (a client gone, an error) sets `cancel`, which stops the engine
    between steps, or stops the wait when another answer holds the engine."""
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()

    def post(item) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:
            if not loop.is_closed():
                raise   # a closed loop means the request ended early (an error, a client gone): nobody reads on

    def produce() -> None:
        try:
            for event in service.reply(list(req.messages), req.system_prompt, req.sampling, req.stop, cancel,
                                       strategy=req.strategy, every_s=STREAM_EVERY_S):
                post(event)
        except Exception as exc:  # noqa: BLE001 - handed to the request, which reports it
            post(exc)
        finally:
            post(_DONE)

    threading.Thread(target=produce, name="aerie-api-reply", daemon=True).start()
    try:
        while (item := await queue.get()) is not _DONE:
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        cancel.set()


@dataclass(frozen=True)
class Answer:
    """What the events of one reply add up to."""

    text: str = ""
    stats: ReplyStats = ReplyStats()
    finish: str | None = None
    notices: tuple[str, ...] = ()

    def add(self, event: ReplyEvent) -> "Answer":
        notices = self.notices + ((event.notice,) if event.notice and event.notice not in self.notices else ())
        return replace(self, text=self.text + event.delta, stats=event.stats, finish=event.finish or self.finish,
                       notices=notices)


def usage(stats: ReplyStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens}


def speculation(answer: Answer) -> dict:
    """Aerie's own numbers: decode tokens per second (after the first token) and the time to the
    first token (the prefill), mean accepted length per target step (the bonus token included),
    the share of drafted tokens the target accepted, the measured speedup over plain decoding
    (None until the latency profile knows it), the drafter and the tuner's reason."""
    s = answer.stats
    return {"tok_s": round(s.decode_tok_s, 2), "ttft_s": round(s.prefill_s, 3) if s.new_tokens else None,
            "accept_len": round(s.accept_len, 3),
            "accept_rate": None if s.accept_rate is None else round(s.accept_rate, 3),
            "speedup": None if s.speedup is None else round(s.speedup, 3), "strategy": s.strategy,
            "tuning": s.tuning, "target_steps": s.target_steps, "drafted": s.drafted, "accepted": s.accepted,
            "elapsed_s": round(s.elapsed_s, 3), "notices": list(answer.notices)}


@dataclass(frozen=True)
class Head:
    """The fields every response and chunk of one completion share."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, model: str) -> "Head":
        return cls(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model)

    def fields(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def completion_body(head: Head, answer: Answer) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": answer.text}, "logprobs": None,
              "finish_reason": FINISH_REASONS.get(answer.finish or "", "stop")}
    return {**head.fields("chat.completion"), "choices": [choice], "usage": usage(answer.stats),
            "aerie": speculation(answer)}


def chunk(head: Head, delta: dict, finish: str | None = None, **extra: Any) -> str:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return sse({**head.fields("chat.completion.chunk"), "choices": [choice], **extra})


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def stream_chunks(head: Head, req: CompletionRequest, first: ReplyEvent, events: AsyncIterator[ReplyEvent],
                        cancel: threading.Event) -> AsyncIterator[str]:
    """The answer as OpenAI's chunks: the role first, then text deltas, then the finish reason
    with Aerie's statistics, the usage when asked for (`stream_options.include_usage`), [DONE].
    A failure after the first chunk can only be told in the stream: an "error" event."""
    answer = Answer().add(first)
    try:
        yield chunk(head, {"role": "assistant", "content": first.delta})
        async for event in events:
            answer = answer.add(event)
            if event.delta:
                yield chunk(head, {"content": event.delta})
        finish = FINISH_REASONS.get(answer.finish or "", "stop")
        yield chunk(head, {}, finish, aerie=speculation(answer))
        if req.include_usage:
            yield sse({**head.fields("chat.completion.chunk"), "choices": [], "usage": usage(answer.stats)})
    except AerieError as exc:
        yield sse(aerie_error(exc).body())
    except Exception as exc:  # noqa: BLE001 - the stream has begun: the client learns of it in-band
        yield sse(unexpected_error(exc).body())
    finally:
        cancel.set()  # the client went away, or the answer is complete: either way the engine may stop
    yield "data: [DONE]\n\n"


async def complete(service: ChatServiceApi, request: Request, req: CompletionRequest, head: Head):
    """One completion. The first event is awaited before answering, so that a prompt that does
    not fit, or any failure before the first token, is a plain JSON error with its status."""
    cancel = threading.Event()
    events = reply_events(service, req, cancel)
    try:
        first = await anext(events, None)
    except AerieError as exc:
        return error_response(aerie_error(exc))
    if first is None:
        return error_response(ApiError(503, "The answer was cancelled before it began.", type="server_error"))
    if req.stream:
        return StreamingResponse(stream_chunks(head, req, first, events, cancel), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    answer = Answer().add(first)
    try:
        async for event in events:
            answer = answer.add(event)
            if await request.is_disconnected():
                break  # nobody to answer: the generator's exit cancels the engine
    except AerieError as exc:
        return error_response(aerie_error(exc))
    finally:
        await events.aclose()
    return JSONResponse(completion_body(head, answer))


def api_routes(service: ChatServiceApi, api_key: str | None = None, defaults: SamplingConfig = SamplingConfig()) -> list[BaseRoute]:
    """The /v1 routes for `service`. With `api_key` set, each request must bear it; omitted
    sampling fields take `defaults` (the page's: greedy unless launch.py says otherwise)."""
    router = APIRouter(prefix="/v1")

    @router.get("/models")
    async def models(request: Request):
        if denied := check_key(request, api_key):
            return error_response(denied)
        model = {"id": service.model_name, "object": "model", "created": 0, "owned_by": "aerie"}
        return JSONResponse({"object": "list", "data": [model]})

    @router.post("/chat/completions")
    async def chat_completions(request: Request):
        if denied := check_key(request, api_key) or check_json(request):
            return error_response(denied)
        try:
            body = json.loads(await request.body() or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error_response(ApiError(400, f"The request body is not valid JSON: {exc}."))
        except RecursionError:
            return error_response(ApiError(400, "The request body is nested too deeply to read."))
        try:
            req = parse_request(body, defaults)
        except ApiError as exc:
            return error_response(exc)
        try:
            return await complete(service, request, req, Head.new(service.model_name))
        except Exception as exc:  # noqa: BLE001 - an OpenAI-shaped 500 instead of a bare one
            return error_response(unexpected_error(exc))

    return list(router.routes)
