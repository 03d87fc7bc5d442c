"""The front process: one OpenAI-compatible endpoint that routes by `model` to the Instance
serving it, and turns an engine failure caused by the deployment into an error naming the
failed member (asked from the daemon).

It is a member of its generation like any other: it registers once it listens, sends
heartbeats (request counts, in-flight requests) and learns the generation's phase from the
answers, so it refuses new requests as soon as the daemon fails or stops the generation. It
outlives an Instance that fails alone: the answers name the models whose Instance restarts, and
the front ends their requests in flight and answers them 503 with Retry-After until they are back.
On SIGTERM (the daemon's ordered stop, or the daemon's death through PR_SET_PDEATHSIG) it stops
accepting and answers every request still in flight with 503 at once: an engine that is being
stopped may hold its requests open until its own grace ends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from types import FrameType
from typing import TypeVar

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from crosspool.bodylimit import BodyLimit
from crosspool.ipc import die_with_supervisor, supervisor_gone, supervisor_pid
from crosspool.member import ControlClient, load_membership
from crosspool.metrics import MemberMetrics
from crosspool.plan import Plan

FAILURE_SETTLE_S = 3.0  # how long an upstream error waits for the daemon to name its cause
REQUEST_TIMEOUT_S = 600.0


T = TypeVar("T")


class Stopping(Exception):
    pass


def _sse_error(message: str) -> bytes:
    """An error event in an OpenAI stream whose HTTP status is already sent."""
    return f"data: {json.dumps({'error': {'message': message, 'code': 503}})}\n\n".encode()


def _error(status: int, message: str, kind: str, retry_after_s: int | None = None) -> JSONResponse:
    headers = None if retry_after_s is None else {"Retry-After": str(retry_after_s)}
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": status}}, status_code=status, headers=headers
    )


class Front:
    def __init__(self, plan: Plan, secret: str) -> None:
        self.plan = plan
        self.upstreams = {m.id: m.url for m in plan.models}
        self.max_model_len = {m.id: m.max_model_len for m in plan.models}
        self.control = ControlClient(plan, secret, "front", "front")
        self.inflight = 0
        self.at_engine = dict.fromkeys(self.upstreams, 0)
        self.requests: dict[str, dict[str, int]] = {}
        self.daemon = httpx.AsyncClient(base_url=plan.control_url, timeout=2.0)
        self.stopping: asyncio.Event | None = None  # set on SIGTERM or a failure: in-flight requests end now
        self.model_down: dict[str, asyncio.Event] = {}  # set when the model's Instance fails alone
        self.loop: asyncio.AbstractEventLoop

    def end_in_flight(self, models: list[str] | None = None) -> None:
        """From any thread: every request in flight (of `models`; None: all) answers 503 now
        (`unless_stopping`)."""
        if self.stopping is None:
            return
        events = [self.stopping] if models is None else [self.model_down[m] for m in models]
        for event in events:
            self.loop.call_soon_threadsafe(event.set)

    def down_event(self, model: str) -> asyncio.Event:
        """The event that ends `model`'s requests in flight: a fresh one once its Instance is back."""
        event = self.model_down[model]
        if event.is_set() and model not in self.control.down:
            event = self.model_down[model] = asyncio.Event()
        return event

    async def unless_stopping(self, aw: Awaitable[T], model: str) -> T:
        """Await `aw`, unless the front is told to stop, or `model`'s Instance fails, first (then
        raise Stopping). An engine being stopped may hold a request open until its own grace
        ends; ours must end at once."""
        assert self.stopping is not None
        task = asyncio.ensure_future(aw)
        stops = {asyncio.ensure_future(e.wait()) for e in (self.stopping, self.down_event(model))}
        done, _ = await asyncio.wait({task, *stops}, return_when=asyncio.FIRST_COMPLETED)
        for stop in stops:
            stop.cancel()
        if task in done:
            return task.result()
        task.cancel()
        raise Stopping

    def stop_reason(self, model: str) -> str:
        if self.control.failure is not None:
            return f"CrossPool deployment failed: {self.control.failure}"
        if model in self.control.down:
            return f"CrossPool Instance '{model}' failed: {self.control.down[model].reason}"
        if supervisor_gone():
            return f"CrossPool deployment failed: the CrossPool daemon (pid {supervisor_pid()}) exited"
        return "CrossPool deployment failed: the deployment is shutting down"

    def metrics(self) -> MemberMetrics:
        return MemberMetrics(
            requests={m: dict(c) for m, c in self.requests.items()}, inflight=self.inflight, at_engine=self.at_engine
        )

    def count(self, model: str, status: int) -> None:
        classes = self.requests.setdefault(model if model in self.upstreams else "unknown", {})
        key = f"{status // 100}xx"
        classes[key] = classes.get(key, 0) + 1

    def over_length(self, model: str, body: dict) -> str | None:
        """Why the request cannot fit the model's max_model_len, where the front can tell without a
        tokenizer (output tokens, token-id prompts); text prompts are the engine's to measure."""
        limit = self.max_model_len[model]
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        if max_tokens is not None and not (isinstance(max_tokens, int) and max_tokens >= 0):
            return f"max_tokens must be a non-negative integer (got {max_tokens!r})"
        prompt = body.get("prompt")
        prompt_tokens = len(prompt) if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else 0
        if prompt_tokens + (max_tokens or 0) > limit:
            return (
                f"{prompt_tokens} prompt tokens + max_tokens {max_tokens or 0} exceed {model}'s max_model_len {limit}"
                if prompt_tokens
                else f"max_tokens {max_tokens} exceeds {model}'s max_model_len {limit}"
            )
        return None

    def refusal(self, model: str | None = None) -> JSONResponse | None:
        if self.control.failure is not None:
            return _error(503, f"CrossPool deployment failed: {self.control.failure}", "crosspool_failure")
        if self.control.phase == "stopping":
            return _error(503, "CrossPool deployment is shutting down", "crosspool_shutdown")
        down = self.control.down.get(model) if model is not None else None
        if model is not None and down is not None:
            message = f"CrossPool Instance '{model}' is restarting after a failure: {down.reason}"
            return _error(503, message, "crosspool_restarting", self.retry_after_s(model))
        return None

    async def named_failure(self, model: str) -> str:
        """The failure that took `model`'s requests, as the daemon names it (it may take a moment
        to notice): the deployment's, or the model's Instance's."""
        loop = asyncio.get_running_loop()
        end = loop.time() + FAILURE_SETTLE_S
        while True:
            try:
                status = (await self.daemon.get("/status")).json()
                failure, instance = status["failure"], status["models"][model]["failure"]
            except (httpx.HTTPError, ValueError, KeyError):
                return (
                    f"CrossPool deployment failed: CrossPool daemon at {self.plan.control_url} unreachable "
                    "(the deployment is stopping)"
                )
            if failure is not None:
                return f"CrossPool deployment failed: {failure}"
            if instance is not None:
                return f"CrossPool Instance '{model}' failed: {instance}"
            if loop.time() > end:
                return "CrossPool deployment failed: no member failure reported"
            await asyncio.sleep(0.05)

    async def failure_message(self, model: str, upstream_error: str) -> str:
        return f"{await self.named_failure(model)} (engine said: {upstream_error[:200]})"

    async def failed_response(self, model: str, upstream_error: str) -> JSONResponse:
        message = await self.failure_message(model, upstream_error)
        return _error(503, message, "crosspool_failure", self.retry_after_s(model))  # learnt by now

    def retry_after_s(self, model: str) -> int | None:
        down = self.control.down.get(model)
        return None if down is None else down.retry_after_s


def create_front(front: Front) -> FastAPI:
    app = FastAPI(title="CrossPool", summary="OpenAI-compatible endpoint of a CrossPool deployment")
    app.add_middleware(BodyLimit, max_bytes=front.plan.max_request_bytes, on_refused=lambda _: front.count("", 413))
    client = httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=5.0))

    @app.get("/health")
    async def health() -> Response:
        return front.refusal() or JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        data = [{"id": m, "object": "model", "owned_by": "crosspool"} for m in front.upstreams]
        return JSONResponse({"object": "list", "data": data})

    async def forward(request: Request, path: str) -> Response:
        front.inflight += 1
        model = "unknown"
        response: Response
        try:
            body = await request.body()
            try:
                request_json = json.loads(body)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                request_json = None
            if not isinstance(request_json, dict) or not isinstance(request_json.get("model"), str):
                response = _error(
                    400, "request body must be a JSON object with a 'model' field", "invalid_request_error"
                )
            elif request_json["model"] not in front.upstreams:
                served = sorted(front.upstreams)
                response = _error(
                    404, f"model {request_json['model']!r} is not served; served models: {served}", "not_found_error"
                )
            else:
                model = request_json["model"]
                too_long = front.over_length(model, request_json)
                response = (
                    _error(400, too_long, "invalid_request_error")
                    if too_long
                    else front.refusal(model) or await _served(body, model, path)
                )
        finally:
            front.inflight -= 1
        front.count(model, response.status_code)
        return response

    async def _served(body: bytes, model: str, path: str) -> Response:
        front.at_engine[model] += 1
        try:
            return await front.unless_stopping(_forward(body, model, front.upstreams[model] + path), model)
        except Stopping:
            return _error(503, front.stop_reason(model), "crosspool_failure", front.retry_after_s(model))
        finally:
            front.at_engine[model] -= 1

    async def stream_error(model: str, upstream_error: str) -> bytes:
        return _sse_error(await front.failure_message(model, upstream_error))

    async def _forward(body: bytes, model: str, url: str) -> Response:
        upstream = client.build_request("POST", url, content=body, headers={"content-type": "application/json"})
        try:
            resp = await client.send(upstream, stream=True)
        except httpx.HTTPError as e:
            return await front.failed_response(model, f"{type(e).__name__}: {e}")
        if resp.status_code >= 500:
            text = (await resp.aread()).decode(errors="replace")
            await resp.aclose()
            return await front.failed_response(model, f"HTTP {resp.status_code}: {text}")
        if not resp.headers.get("content-type", "").startswith("text/event-stream"):
            content = await resp.aread()
            await resp.aclose()
            return Response(content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))

        async def events() -> AsyncIterator[bytes]:
            # Line by line: vLLM reports an engine death inside a stream as an error event whose
            # text cannot name the cause ("EngineCore encountered an issue"); the front replaces it.
            front.inflight += 1
            front.at_engine[model] += 1
            lines = resp.aiter_lines()
            try:
                while True:
                    try:
                        line = await front.unless_stopping(anext(lines), model)
                    except StopAsyncIteration:
                        return
                    if line.startswith('data: {"error"'):
                        yield await stream_error(model, line[6:])
                        return
                    yield (line + "\n").encode()
            except httpx.HTTPError as e:
                yield await stream_error(model, f"stream broke: {e}")
            except Stopping:
                yield _sse_error(front.stop_reason(model))
            finally:
                front.inflight -= 1
                front.at_engine[model] -= 1
                await resp.aclose()

        return StreamingResponse(events(), status_code=resp.status_code, media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    @app.on_event("startup")
    async def join() -> None:
        front.stopping, front.loop = asyncio.Event(), asyncio.get_running_loop()
        front.model_down = {model: asyncio.Event() for model in front.upstreams}
        # After a failure its mailboxes are fenced: no request in flight there can finish, and one
        # held by a hung engine would wait out the drain and the engine's stop. It ends now, named.
        front.control.on_failure = lambda _: front.end_in_flight()
        front.control.on_down = front.end_in_flight
        # uvicorn runs startup before it listens; registering from a thread a moment later would
        # race the port. The daemon also checks the port itself before it reports ready.
        front.control.register()
        front.control.start_heartbeats(front.metrics)

    @app.on_event("shutdown")
    async def close() -> None:
        front.control.close()
        await client.aclose()
        await front.daemon.aclose()

    return app


class FrontServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, front: Front) -> None:
        super().__init__(config)
        self.front = front

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the event loop's thread; requests in flight answer 503 right away.
        self.front.end_in_flight()
        super().handle_exit(sig, frame)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="crosspool-front")
    parser.add_argument("--plan", type=Path, required=True)
    parser.add_argument("--grace-s", type=float, default=10.0)
    args = parser.parse_args(argv)
    die_with_supervisor(noted=True)
    plan, secret = load_membership(args.plan)
    front = Front(plan, secret)
    config = uvicorn.Config(
        create_front(front),
        host=plan.host,
        port=plan.port,
        log_level="warning",
        timeout_graceful_shutdown=int(args.grace_s),
    )
    FrontServer(config, front).run()


if __name__ == "__main__":
    main()
