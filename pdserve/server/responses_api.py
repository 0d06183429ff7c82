"""`POST /v1/responses` request bodies (OpenAI's Responses API) and their chat form.

Every field the `openai` client's `responses.create` sends is declared here, implemented
or refused by name (request_fields.py); docs/api.md lists them and
tests/test_agent_apis.py checks each against the installed client's signature. The
request becomes a chat completions body (`to_chat`) and runs on the chat path
(chat_bridge.py): the same template, tool parsing, grammars and engine.

Responses are not stored: `store: true`, `previous_response_id` and `conversation` are
refused by name (a client sends the whole conversation as `input` items).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from pdserve.server.openai_api import StreamOptions
from pdserve.server.request_fields import Body, FieldRefused, short_repr
from pdserve.server.responses_items import Item, MessageItem, chat_messages, parse_item

BUILTIN_TOOLS = (
    "function tools only; built-in tools (web_search, file_search, "
    "computer_use, ...) are not supported by this server"
)


class FunctionTool(Body):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: Any = None
    allowed_callers: Any = None
    output_schema: Any = None
    NOT_IMPLEMENTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "defer_loading": (False,), "allowed_callers": (), "output_schema": ()}  # fmt: skip

    def check_fields(self, unknown: str = "refuse", where: str = "") -> None:
        if self.type != "function":
            raise FieldRefused(f"{where}type: tool type {self.type!r} is not supported "
                               f"({BUILTIN_TOOLS})", where + "type")  # fmt: skip
        if not self.name:
            raise FieldRefused(f"{where}name is required in a function tool", where + "name")
        super().check_fields(unknown, where)

    def chat(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters or {}}
        if self.description is not None:
            fn["description"] = self.description
        if self.strict is not None:
            fn["strict"] = self.strict
        return {"type": "function", "function": fn}


class TextFormat(Body):
    type: Literal["text", "json_schema", "json_object"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    def chat(self) -> dict[str, Any] | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        spec: dict[str, Any] = {"name": self.name or "output", "schema": self.schema_ or {}}
        spec |= {k: v for k, v in (("strict", self.strict), ("description", self.description))
                 if v is not None}  # fmt: skip
        return {"type": "json_schema", "json_schema": spec}


class TextConfig(Body):
    format: TextFormat | None = None
    verbosity: Any = None
    NOT_IMPLEMENTED: ClassVar[dict[str, tuple[Any, ...]]] = {"verbosity": ()}


class Reasoning(Body):
    effort: Any = None
    summary: Any = None
    generate_summary: Any = None
    NOT_IMPLEMENTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "effort": (), "summary": (), "generate_summary": ()}  # fmt: skip


class ResponsesIn(Body):
    """A `POST /v1/responses` body."""

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    reasoning: Reasoning | None = None
    include: list[str] | None = None
    truncation: Literal["disabled"] | str | None = None
    store: bool | None = None
    # identify the caller or tag the request; by definition they change no output
    user: str | None = None
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    # extensions: the PD router's fields and sglang's request id
    rid: str | None = None
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None
    # known, not implemented
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    background_options: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    top_logprobs: Any = None
    context_management: Any = None
    access_programs: Any = None
    image: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    NOT_IMPLEMENTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "store": (False,),
        "truncation": ("disabled",),
        "service_tier": ("auto", "default"),
        "previous_response_id": (),
        "conversation": (),
        "background": (False,),
        "background_options": (),
        "prompt": (),
        "max_tool_calls": (),
        "top_logprobs": (0,),
        "context_management": (),
        "access_programs": (),
        "image": (),
        "moderation": (),
        "prompt_cache_options": (),
        "prompt_cache_retention": (),
    }

    def check_fields(self, unknown: str = "refuse", where: str = "") -> None:
        super().check_fields(unknown, where)
        if self.include:
            raise FieldRefused(f"include {short_repr(self.include)} is not supported by this "
                               "server (no extra output data)", "include")  # fmt: skip
        if self.stream_options is not None and not self.stream:
            raise FieldRefused("stream_options is only allowed with stream", "stream_options")
        self.items()  # refuses an input item by name

    def items(self) -> list[Item]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return [parse_item(raw, f"input.{i}.") for i, raw in enumerate(self.input)]

    def chat_tool_choice(self) -> Any:
        c = self.tool_choice
        if c is None or c in ("none", "auto", "required"):
            return c
        if isinstance(c, dict) and c.get("type") == "function" and set(c) <= {"type", "name"}:
            return {"type": "function", "function": {"name": c.get("name")}}
        raise FieldRefused(f"tool_choice {short_repr(c)} is not supported by this server "
                           '("none", "auto", "required" or a named function)', "tool_choice")  # fmt: skip

    def to_chat(self) -> dict[str, Any]:
        """The chat completions body of this request (call check_fields first)."""
        chat: dict[str, Any] = {"messages": chat_messages(self.instructions, self.items())}
        if self.tools is not None:
            chat["tools"] = [t.chat() for t in self.tools]
        fmt = self.text.format if self.text is not None else None
        for name, value in (
            ("tool_choice", self.chat_tool_choice()),
            ("parallel_tool_calls", self.parallel_tool_calls),
            ("max_completion_tokens", self.max_output_tokens),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("response_format", fmt.chat() if fmt is not None else None),
            ("rid", self.rid),
            ("bootstrap_host", self.bootstrap_host),
            ("bootstrap_port", self.bootstrap_port),
            ("bootstrap_room", self.bootstrap_room),
        ):
            if value is not None:
                chat[name] = value
        chat["stream"] = bool(self.stream)
        return chat


# chat field -> the Responses field a refusal names
RENAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
           "response_format.json_schema": "text.format", "response_format": "text.format"}  # fmt: skip
