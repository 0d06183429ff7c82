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

from pdserve.server.generation import RequestError
from pdserve.server.http_util import parse
from pdserve.server.openai_api import StreamOptions
from pdserve.server.request_fields import Body, FieldRefused, short_repr

BUILTIN_TOOLS = "function tools only; built-in tools (web_search, file_search, computer_use, ...) are not supported by this server"  # noqa: E501


class InputPart(Body):
    """A part of a message's content: text only."""

    type: str
    text: str | None = None
    refusal: str | None = None
    annotations: Any = None  # output_text's, of the model's own answer
    logprobs: Any = None  # output_text's, of the model's own answer
    prompt_cache_breakpoint: Any = None  # a cache hint; the prefix cache needs none

    def check_fields(self, unknown: str = "refuse", where: str = "") -> None:
        if self.type not in ("input_text", "output_text", "refusal", "text"):
            raise FieldRefused(f"{where}type: content parts of type {self.type!r} are not "
                               "supported by this server (text only)", where + "type")  # fmt: skip
        super().check_fields(unknown, where)

    @property
    def content(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


class MessageItem(Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]
    id: str | None = None
    status: str | None = None
    phase: str | None = None  # the model's own label of its answer; changes no prompt text

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.content or "" for p in self.content)


class FunctionCallItem(Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None
    namespace: Any = None
    caller: Any = None
    NOT_IMPLEMENTED: ClassVar[dict[str, tuple[Any, ...]]] = {"namespace": (), "caller": ()}


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputPart]
    id: str | None = None
    status: str | None = None
    name: str | None = None  # the tool's name; the chat template keys results by call id
    namespace: Any = None
    caller: Any = None
    NOT_IMPLEMENTED: ClassVar[dict[str, tuple[Any, ...]]] = {"namespace": (), "caller": ()}

    @property
    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(p.content or "" for p in self.output)


class ReasoningPart(Body):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Body):
    """The model's reasoning of an earlier turn (as this server returns it): the next
    assistant turn's reasoning_content."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None
    status: str | None = None
    encrypted_content: Any = None
    NOT_IMPLEMENTED: ClassVar[dict[str, tuple[Any, ...]]] = {"encrypted_content": ()}

    @property
    def text(self) -> str:
        return "".join(p.text for p in (self.content or self.summary))


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
ITEMS: dict[str, type[Body]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                "function_call_output": FunctionCallOutputItem,
                                "reasoning": ReasoningItem}  # fmt: skip


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
        return [_item(raw, f"input.{i}.") for i, raw in enumerate(self.input)]

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


def _item(raw: Any, where: str) -> Item:
    if not isinstance(raw, dict):
        raise FieldRefused(f"{where[:-1]}: an input item must be an object", where[:-1])
    kind = raw.get("type", "message")
    model = ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise FieldRefused(f"{where}type: input items of type {short_repr(kind)} are not "
                           "supported by this server (message, function_call, "
                           "function_call_output, reasoning)", where + "type")  # fmt: skip
    try:
        item = parse(model, raw)
    except RequestError as e:
        raise FieldRefused(f"{where}{e.message}", where + (e.param or "")) from e
    item.check_fields("refuse", where)
    return item  # type: ignore[return-value]


def chat_messages(instructions: str | None, items: list[Item]) -> list[dict[str, Any]]:
    """The chat messages of the input items: a reasoning item, the assistant text and the
    function calls that follow it form one assistant message (reasoning_content,
    content, tool_calls)."""
    out: list[dict[str, Any]] = []
    if instructions is not None:
        out.append({"role": "system", "content": instructions})
    for item in items:
        last = out[-1] if out else None
        if isinstance(item, ReasoningItem):
            out.append({"role": "assistant", "content": None, "reasoning_content": item.text})
        elif isinstance(item, MessageItem) and item.role == "assistant" and _open(last):
            last["content"] = item.text  # type: ignore[index]
        elif isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
        else:
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return out


def _open(msg: dict[str, Any] | None) -> bool:
    """An assistant message holding only reasoning so far (its text may follow)."""
    return (
        msg is not None
        and msg["role"] == "assistant"
        and msg["content"] is None
        and not msg.get("tool_calls")
    )
