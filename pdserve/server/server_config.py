"""Frontend (HTTP) settings of a prefill or decode server; the engine's live in pdserve.config.
A field with a flag is set by the flag named after it (config.flag_of)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

UNKNOWN_FIELD_POLICIES = ("refuse", "warn")


@dataclass(frozen=True)
class ServerConfig:
    role: str  # "prefill" | "decode"
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None  # default: the model folder's name
    api_key: str | None = None  # bearer key required on every route but /health
    metrics_public: bool = False  # True: /metrics answers without the key (a scraper's)
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies get 413
    engine_start_timeout_s: float = 600.0
    engine_heartbeat_timeout_s: float = 60.0  # engine silent this long: considered dead
    health_generate_timeout_s: float = 20.0
    drain_timeout_s: float = 30.0  # SIGTERM: requests in flight may finish this long (drain.py)
    default_max_new_tokens: int = 128  # /generate without sampling_params.max_new_tokens
    log_level: str = "info"
    # a request field the server does not know: "refuse" (400 naming it) or "warn" (logged)
    unknown_fields: str = "refuse"
    chat_template: str | None = None  # a Jinja file that replaces the model's chat template
    allowed_origins: tuple[str, ...] = ()  # origins allowed cross-origin ("*": any); none: no CORS
    # how tool calls are found in the output: a parser name (tool_calls.py), "auto" (from
    # the chat template) or "none"
    tool_call_parser: str = "auto"
    # how a chat answer's reasoning is split from its content (reasoning.py); None: not split
    reasoning_parser: str | None = None

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_path).name or self.model_path
