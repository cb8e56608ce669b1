"""GET /v1/models, /health and /metrics."""

from __future__ import annotations

import msgspec
from aiohttp import web

from kvfork.server.api.openai import Health, ModelCard, ModelList
from kvfork.server.api.respond import json_response
from kvfork.server.common.state import holds_metrics_key, services_of
from kvfork.server.guard.errors import ApiError
from kvfork.server.pool.pool import ModelPool
from kvfork.server.pool.views import pool_cards, pool_health, pool_metrics

PATH = "/v1/models"


async def list_models(request: web.Request) -> web.Response:
    services = services_of(request)
    if isinstance(services.models, ModelPool):
        return json_response(pool_cards(services.models, services.created))
    model = services.current()
    context = model.info.context_length if model.ready else None
    return json_response(ModelList([ModelCard(name, services.created, max_model_len=context)
                                    for name in model.served_names]))


async def health(request: web.Request) -> web.Response:
    """200 once the model is loaded, with the memory plan; 503 while it loads (saying which phase: progress.py)
    and after the runner has died, an OpenAI error body either way."""
    services = services_of(request)
    detailed = holds_metrics_key(request)
    if isinstance(services.models, ModelPool):  # ready: a model loads when a request names it
        return json_response(pool_health(services.models, detailed))
    model = services.current()
    try:
        model.require_ready()
    except ApiError as e:
        status = "failed" if model.engine.dead else "loading"
        body = {**msgspec.to_builtins(e.body()), "status": status, "phase": model.progress.phase}
        if model.engine.dead and detailed:
            body["error"]["message"] = f"the model runner has stopped: {model.engine.failure}"
        return json_response(body, status=e.status)
    return json_response(Health(phase=model.progress.phase, memory=model.engine.memory))


async def metrics(request: web.Request) -> web.Response:
    services = services_of(request)
    models = services.models
    text = pool_metrics(models) if isinstance(models, ModelPool) else services.registry.render()
    return web.Response(text=text, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
