"""The deployment's one OpenAI-compatible endpoint: routes by `model` to the serving Instance,
and turns an engine failure caused by the FFN pool into an error that names the failed member."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

FAILURE_SETTLE_S = 3.0  # how long an upstream error waits for the supervisor to name its cause


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def create_front(upstreams: dict[str, str], failure: Callable[[], str | None], request_timeout_s: float) -> FastAPI:
    """`upstreams`: model id -> engine base URL; `failure`: the deployment's first failure, if any."""
    app = FastAPI(title="CrossPool", summary="OpenAI-compatible front of a CrossPool deployment")
    client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=5.0))
    app.state.inflight = 0
    app.state.accepting = True

    async def named_failure() -> str | None:
        loop = asyncio.get_running_loop()
        end = loop.time() + FAILURE_SETTLE_S
        while (reason := failure()) is None and loop.time() < end:
            await asyncio.sleep(0.05)
        return reason

    async def failed_response(upstream_error: str) -> JSONResponse:
        reason = await named_failure()
        if reason is not None:
            return _error(503, f"CrossPool deployment failed: {reason}", "crosspool_failure")
        return _error(502, f"engine error: {upstream_error}", "engine_failure")

    @app.get("/health")
    async def health() -> Response:
        reason = failure()
        if reason is not None:
            return _error(503, f"CrossPool deployment failed: {reason}", "crosspool_failure")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        data = [{"id": m, "object": "model", "owned_by": "crosspool"} for m in upstreams]
        return JSONResponse({"object": "list", "data": data})

    async def forward(request: Request, path: str) -> Response:
        app.state.inflight += 1
        try:
            return await _forward(request, path)
        finally:
            app.state.inflight -= 1

    async def _forward(request: Request, path: str) -> Response:
        if not app.state.accepting:
            return _error(503, "CrossPool deployment is shutting down", "crosspool_shutdown")
        reason = failure()
        if reason is not None:
            return _error(503, f"CrossPool deployment failed: {reason}", "crosspool_failure")
        body = await request.body()
        try:
            model = json.loads(body).get("model")
        except (json.JSONDecodeError, AttributeError):
            return _error(400, "request body must be a JSON object with a 'model' field", "invalid_request_error")
        if model not in upstreams:
            return _error(404, f"model {model!r} is not served; served models: {sorted(upstreams)}", "not_found_error")
        upstream = client.build_request(
            "POST", upstreams[model] + path, content=body, headers={"content-type": "application/json"}
        )
        try:
            resp = await client.send(upstream, stream=True)
        except httpx.HTTPError as e:
            return await failed_response(f"{type(e).__name__}: {e}")
        if resp.status_code >= 500:
            text = (await resp.aread()).decode(errors="replace")
            await resp.aclose()
            return await failed_response(f"HTTP {resp.status_code}: {text[:300]}")
        if not resp.headers.get("content-type", "").startswith("text/event-stream"):
            content = await resp.aread()
            await resp.aclose()
            return Response(content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))

        async def events() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:
                reason = await named_failure() or f"engine stream broke: {e}"
                event = {"error": {"message": f"CrossPool deployment failed: {reason}"}}
                yield f"data: {json.dumps(event)}\n\n".encode()
            finally:
                await resp.aclose()

        return StreamingResponse(events(), status_code=resp.status_code, media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    @app.on_event("shutdown")
    async def close_client() -> None:
        await client.aclose()

    return app
