"""Request bodies into prompt ids: parsing with the field policy, the model check, the
chat template (shared by the OpenAI routes and /tokenize)."""

from __future__ import annotations

from typing import Any, TypeVar

from pdserve.server.chat_template import continue_final_message
from pdserve.server.generation import Frontend, RequestError
from pdserve.server.http_util import parse
from pdserve.server.openai_api import ChatTemplateControls
from pdserve.server.request_fields import Body, FieldRefused
from pdserve.server.server_config import ServerConfig
from pdserve.server.tokenizer import ChatTemplateError

B = TypeVar("B", bound=Body)
# names the chat template gets from the request itself, not from chat_template_kwargs
RESERVED_TEMPLATE_NAMES = {"messages", "tools", "documents", "add_generation_prompt"}


def parse_body(model: type[B], data: Any, cfg: ServerConfig) -> B:
    """The validated body; RequestError 400 naming a field refused (request_fields.py)."""
    body = parse(model, data)
    try:
        body.check_fields(cfg.unknown_fields)
    except FieldRefused as e:
        raise RequestError(str(e), e.param) from e
    return body


def check_model(model: str | None, cfg: ServerConfig) -> None:
    """A request naming a model must name ours (served name or path); 404 otherwise."""
    if model is not None and model not in (cfg.model_name, cfg.model_path):
        raise RequestError(f"model {model!r} does not exist; this server serves "
                           f"{cfg.model_name!r}", "model", status=404)  # fmt: skip


def completion_prompts(fe: Frontend, prompt: Any) -> list[list[int]]:
    """A string, a list of token ids, or a batch (a list) of those."""
    batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]  # fmt: skip
    out = [fe.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in batch]
    if not out:
        raise RequestError("the prompt is empty", "prompt")
    return out


def chat_prompt_ids(fe: Frontend, body: ChatTemplateControls) -> list[int]:
    messages = [m.for_template() for m in body.messages]
    kwargs = dict(body.chat_template_kwargs or {})
    taken = sorted(kwargs.keys() & RESERVED_TEMPLATE_NAMES)
    if taken:
        raise RequestError(f"chat_template_kwargs may not set {taken[0]!r} (a request field "
                           "sets it)", "chat_template_kwargs")  # fmt: skip
    try:
        text = fe.tokenizer.apply_chat_template(
            messages, tools=body.tools, add_generation_prompt=body.add_generation_prompt, **kwargs
        )
        if body.continue_final_message:
            text = continue_final_message(text, messages[-1]["content"] or "")
    except ChatTemplateError as e:
        raise RequestError(str(e), "messages") from e
    return fe.tokenizer.encode(text, add_special_tokens=False)
