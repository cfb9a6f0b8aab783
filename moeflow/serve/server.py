"""Running ``moeflow serve``'s app under uvicorn, and stopping it by draining.

    engine.start()
    run_server(app, sock=sock, drain_s=30)   # returns after SIGTERM/SIGINT and the drain

uvicorn's own first signal closes the listening socket and waits for open connections, which
neither tells a new request why it is refused nor ends a long generation; and after it returns
uvicorn raises the signal again, so a ``SIGTERM`` would end the process with the signal's status.
Here the first ``SIGTERM`` or ``SIGINT`` drains instead:

1. admission stops: the app's ``draining`` flag makes new generation requests a 503 (the socket
   stays open, so a client hears why) and ``/health`` a 503 (a load balancer takes the server
   out); the engine refuses new requests (``EngineClosed``) and ends the queued ones
   (finish_reason ``"shutdown"``);
2. the running requests finish, for up to ``drain_s`` seconds; those left then end with
   ``"shutdown"`` (``Engine.shutdown``, run off the event loop, which keeps answering);
3. uvicorn then closes the socket and waits for the answers in flight to go out (they all have
   their final events by now), up to ``GRACEFUL_S``; ``run_server`` returns and the command exits 0.

A second signal during the drain stops waiting for answers to go out (uvicorn's forced exit);
the drain itself still ends within ``drain_s``, as the engine's thread must finish its step.
"""

from __future__ import annotations

import asyncio
import socket
import threading

import uvicorn

__all__ = ["run_server", "GRACEFUL_S"]

GRACEFUL_S = 10.0  # after the drain: how long the last answers may take to go out


class _DrainingServer(uvicorn.Server):
    """uvicorn's server whose first signal drains (module docstring)."""

    def __init__(self, config: uvicorn.Config, state, drain_s: float) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config)
        self._state, self._drain_s = state, drain_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._drain_task: asyncio.Task | None = None
        self.drained = threading.Event()

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)

    def handle_exit(self, sig: int, frame) -> None:  # type: ignore[no-untyped-def]
        # not uvicorn's: it records the signal to raise it again on the way out
        if self._draining or self._loop is None:
            self.force_exit = self.should_exit = True
            return
        self._draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._state.draining = True
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await asyncio.to_thread(self._state.engine.shutdown, drain_s=self._drain_s)
            self.drained.set()
        finally:
            self.should_exit = True


def run_server(app, *, sock: socket.socket, drain_s: float, log_level: str = "info",  # type: ignore[no-untyped-def]
               access_log: bool = True) -> None:
    """Serve ``app`` (``create_app``'s, its engine started) on the bound socket ``sock`` until a
    signal and the drain (module docstring); the engine is shut down on every way out."""
    state = app.state.serve
    config = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="off",
                            timeout_graceful_shutdown=GRACEFUL_S)
    server = _DrainingServer(config, state, drain_s)
    try:
        server.run(sockets=[sock])
    finally:
        state.draining = True
        if not server.drained.is_set():  # uvicorn stopped another way (startup failed, forced exit)
            state.engine.shutdown(drain_s=0.0)  # (during a drain: waits for it, which ends in drain_s)
