"""GET /v1/models, /health and /metrics."""

from __future__ import annotations

import msgspec
from aiohttp import web

from kvfork.server.api.openai import Health, ModelCard, ModelList
from kvfork.server.api.respond import json_response
from kvfork.server.common.state import holds_metrics_key, state_of
from kvfork.server.guard.errors import ApiError
from kvfork.server.pool.views import pool_cards, pool_health, pool_metrics

PATH = "/v1/models"


async def list_models(request: web.Request) -> web.Response:
    state = state_of(request)
    if state.pool is not None:
        return json_response(pool_cards(state.pool, state.created))
    info = state.engine.info if state.ready else None
    context = info.context_length if info else None
    return json_response(ModelList([ModelCard(name, state.created, max_model_len=context) for name in state.served_names]))


async def health(request: web.Request) -> web.Response:
    """200 once the model is loaded, with the memory plan; 503 while it loads (saying which phase: progress.py)
    and after the runner has died, an OpenAI error body either way."""
    state = state_of(request)
    detailed = holds_metrics_key(request)
    if state.pool is not None:  # ready: a model loads when a request names it
        return json_response(pool_health(state.pool, detailed))
    try:
        state.require_ready()
    except ApiError as e:
        status = "failed" if state.engine.dead else "loading"
        body = {**msgspec.to_builtins(e.body()), "status": status, "phase": state.progress.phase}
        if state.engine.dead and detailed:
            body["error"]["message"] = f"the model runner has stopped: {state.engine.failure}"
        return json_response(body, status=e.status)
    return json_response(Health(phase=state.progress.phase, memory=state.engine.memory))


async def metrics(request: web.Request) -> web.Response:
    state = state_of(request)
    text = state.registry.render() if state.pool is None else pool_metrics(state.pool)
    return web.Response(text=text, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
