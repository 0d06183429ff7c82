"""Starting an HTTP listener (frontends and router alike).

Every server of pdserve starts through `serve`, so two rules hold for all of them:
- a server that listens beyond loopback without an API key says so loudly at start
  (`exposure_warning`): anyone who can reach the port may then generate;
- the routine polls (`/health`, `/health_generate`, `/metrics`) that orchestrators and
  Prometheus send every few seconds leave no access-log line at INFO
  (`QuietPolls`); a failed poll (status >= 400) is still logged, and at DEBUG all are.
"""

from __future__ import annotations

import ipaddress
import logging
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
    """Install QuietPolls on uvicorn's access logger (once)."""
    access = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, QuietPolls) for f in access.filters):
        access.addFilter(QuietPolls())


def serve(app: Any, *, host: str, port: int, api_key: str | None, what: str, **kw: Any) -> None:
    """Run `app` with uvicorn on host:port until stopped (the one way pdserve listens)."""
    import uvicorn

    warning = exposure_warning(host, api_key, what)
    if warning:
        logger.warning(warning)
    quiet_polls()  # uvicorn keeps existing filters when it configures its loggers
    uvicorn.run(app, host=host, port=port, **kw)
