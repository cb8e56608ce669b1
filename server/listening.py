"""What a daemon (one model's, server/serve.py, or several models', server/pool/daemon.py) listens with: its
state's application on the configured host and port."""

from __future__ import annotations

from kvfork.server.app import Listener, build_app, listen
from kvfork.server.config import ServerConfig
from kvfork.server.state import AppState


class Listening:
    config: ServerConfig
    state: AppState
    listener: Listener | None = None
    port: int = 0  # the configured port until listening; then the port it listens on (--port 0: any free one)

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    async def listen(self) -> None:
        self.listener = await listen(build_app(self.state), self.config.host, self.config.port)
        self.port = self.listener.port
