"""GET /v1/models, /health and /metrics."""

from __future__ import annotations

from aiohttp import web

from kvfork.server.api.openai import Health, ModelCard, ModelList
from kvfork.server.api.respond import json_response
from kvfork.server.state import state_of

PATH = "/v1/models"


async def list_models(request: web.Request) -> web.Response:
    state = state_of(request)
    info = state.engine.info if state.ready else None
    context = info.context_length if info else None
    return json_response(ModelList([ModelCard(name, state.created, max_model_len=context) for name in state.served_names]))


async def health(request: web.Request) -> web.Response:
    """200 once the model is loaded; 503 while it loads and after the runner has died."""
    state_of(request).require_ready()
    return json_response(Health())


async def metrics(request: web.Request) -> web.Response:
    text = state_of(request).registry.render()
    return web.Response(text=text, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
