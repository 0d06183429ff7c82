"""Starting an HTTP listener (frontends and router alike).

Every server of pdserve starts through `serve`, so three rules hold for all of them:
- its port is bound first (`bind`), before the app's start-up loads a model or starts
  an engine: a port already taken fails at once, naming the port and the reason, not
  after a model loaded (uvicorn alone binds after the start-up). Listening itself
  starts once the start-up is done, so until then a client is refused, not left waiting;
- a server that listens beyond loopback without an API key says so loudly at start
  (`exposure_warning`): anyone who can reach the port may then generate;
- the routine polls (`/health`, `/health_generate`, `/metrics`) that orchestrators and
  Prometheus send every few seconds leave no access-log line at INFO
  (`QuietPolls`); a failed poll (status >= 400) is still logged, and at DEBUG all are.
"""

from __future__ import annotations

import ipaddress
import logging
import signal
import socket
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("pdserve.listen")

POLL_PATHS = frozenset({"/health", "/health_generate", "/metrics"})
ACCESS_LOGGER = "uvicorn.access"


def is_loopback(host: str) -> bool:
    """True when `host` accepts connections from this machine only."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname (or "" / "0.0.0.0"): assume it reaches beyond loopback


def exposure_warning(host: str, api_key: str | None, what: str) -> str | None:
    """The warning for `what` listening on `host`, or None when that is safe."""
    if api_key or is_loopback(host):
        return None
    bar = "!" * 72
    return (
        f"\n{bar}\n{what} listens on {host or 'every interface'} WITHOUT an API key:\n"
        "anyone who can reach this port can use the model. Set PDSERVE_API_KEY\n"
        "(or --api-key), or bind 127.0.0.1 and publish the port deliberately\n"
        f"(docs/deploy.md, 'Opening it up').\n{bar}"
    )


class QuietPolls(logging.Filter):
    """Drops uvicorn's access line for a successful routine poll unless logging at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) < 5:
            return True
        path, status = str(args[2]).split("?", 1)[0], args[4]
        if path not in POLL_PATHS or not isinstance(status, int) or status >= 400:
            return True
        return logging.getLogger(ACCESS_LOGGER).isEnabledFor(logging.DEBUG)


def quiet_polls() -> None:
    """Install QuietPolls on uvicorn's access logger, OneLineRefusals on its error logger
    (once each)."""
    for name, kind in ((ACCESS_LOGGER, QuietPolls), ("uvicorn.error", OneLineRefusals)):
        target = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in target.filters):
            target.addFilter(kind())


class StartupRefused(Exception):
    """An app's start-up cannot go on, for a reason meant for the user (a flag the engine
    refused, an engine that died while loading: its own log has the details), not a bug:
    raised from the lifespan, it is logged as its message alone (OneLineRefusals)."""


class OneLineRefusals(logging.Filter):
    """uvicorn logs a failed start-up's traceback; for a StartupRefused only its message
    is kept (the frontend's stack says nothing about why)."""

    MARK = f"{StartupRefused.__module__}.{StartupRefused.__qualname__}: "

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        last = text.rstrip().rpartition("\n")[2]
        if text.startswith("Traceback") and last.startswith(self.MARK):
            record.msg, record.args = last[len(self.MARK) :], ()
        return True


def bind(host: str, port: int, what: str) -> socket.socket:
    """A TCP socket bound to host:port (not yet listening), or SystemExit saying why not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except (OSError, OverflowError) as e:  # OverflowError: a port outside 0-65535
        sock.close()
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise SystemExit(f"{what}: cannot listen on {host}:{port}: {why}") from None
    return sock


def serve(
    app: Any,
    *,
    host: str,
    port: int,
    api_key: str | None,
    what: str,
    sock: socket.socket | None = None,
    stop_when: Callable[[], bool] | None = None,
    on_sigterm: Callable[[], None] | None = None,
    **kw: Any,
) -> None:
    """Run `app` with uvicorn on host:port until stopped (the one way pdserve listens).
    `on_sigterm`: called on the first SIGTERM instead of shutting down (a drain, which
    ends through `stop_when`); a second one, or SIGINT, shuts down.
    `sock`: host:port already bound by `bind` (callers that do slow work first bind
    before it); bound here otherwise. `stop_when`: checked on uvicorn's tick (10 per
    second); True shuts the server down as a SIGTERM would. SystemExit(3), as uvicorn,
    if the app's start-up failed."""
    sock = sock if sock is not None else bind(host, port, what)
    warning = exposure_warning(host, api_key, what)
    if warning:
        logger.warning(warning)
    quiet_polls()  # uvicorn keeps existing filters when it configures its loggers
    try:
        started = run(app, sock, what, stop_when=stop_when, on_sigterm=on_sigterm, host=host,
                      port=port, **kw)  # fmt: skip
    finally:
        sock.close()
    if not started:
        raise SystemExit(3)  # uvicorn's STARTUP_FAILURE; the reason is in the log above


def run(
    app: Any,
    sock: socket.socket,
    what: str = "server",
    stop_when: Callable[[], bool] | None = None,
    on_sigterm: Callable[[], None] | None = None,
    **kw: Any,
) -> bool:
    """uvicorn serving `app` on the bound `sock` until stopped; False if it never started."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:  # uvicorn says where it listens only when it bound the port
                host, port = sock.getsockname()[:2]
                logger.info("%s listening on http://%s:%d", what, _url_host(host), port)

        def handle_exit(self, sig: int, frame: Any) -> None:
            nonlocal on_sigterm
            if sig == signal.SIGTERM and on_sigterm is not None:
                on_sigterm()
                on_sigterm = None  # the next SIGTERM shuts down
                return
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if stop_when is not None and stop_when():
                self.should_exit = True
            return await super().on_tick(counter)

    server = Server(uvicorn.Config(app, **kw))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    return server.started


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
