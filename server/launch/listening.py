"""What a daemon (one model's, server/launch/serve.py, or several models', server/launch/pool_daemon.py) listens with: the
application over its services, on the configured host and port."""

from __future__ import annotations

from aiohttp import web

from kvfork.server.common.config import ServerConfig
from kvfork.server.common.state import Services
from kvfork.server.launch.app import Listener, build_app, listen


class Listening:
    config: ServerConfig
    services: Services
    app: web.Application | None = None  # once listening
    listener: Listener | None = None
    port: int = 0  # the configured port until listening; then the port it listens on (--port 0: any free one)

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    async def listen(self) -> None:
        self.app = build_app(self.services)
        self.listener = await listen(self.app, self.config.host, self.config.port)
        self.port = self.listener.port
