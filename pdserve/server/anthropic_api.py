"""`POST /v1/messages` and `/v1/messages/count_tokens` request bodies (Anthropic's
Messages API) and their chat form.

Every field the `anthropic` client's `messages.create` sends is declared here,
implemented or refused by name (request_fields.py); docs/api.md lists them and
tests/test_agent_apis.py checks each against the installed client's signature. The
request becomes a chat completions body (`to_chat`) and runs on the chat path
(chat_bridge.py). Content blocks: text, tool_use and tool_result (and thinking, read
back as the assistant turn's reasoning_content); images, documents and the server
tools are refused by name.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import Field

from pdserve.server.request_fields import Body, FieldRefused

# a prompt-cache marker: the prefix cache finds shared prefixes by itself, so a marker
# changes no output; accepted wherever Anthropic allows it (as cache_control fields)
CacheHint = Any


class Block(Body):
    """One content block of a message (or of a tool result)."""

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None  # tool_result
    is_error: bool | None = None  # tool_result: the model reads the result's text either way
    thinking: str | None = None  # thinking
    signature: str | None = None  # thinking: Anthropic's own check of its thinking
    cache_control: CacheHint = None
    citations: Any = None
    caller: Any = None
    toolset_name: Any = None
    NOT_IMPLEMENTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "citations": (), "caller": (), "toolset_name": ()}  # fmt: skip
    NEEDS: ClassVar[dict[str, tuple[str, ...]]] = {
        "text": ("text",), "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",),
        "thinking": ("thinking",)}  # fmt: skip

    def check_fields(self, unknown: str = "refuse", where: str = "") -> None:
        if self.type not in self.NEEDS:
            raise FieldRefused(f"{where}type: content blocks of type {self.type!r} are not "
                               "supported by this server (text, tool_use, tool_result, "
                               "thinking)", where + "type")  # fmt: skip
        for name in self.NEEDS[self.type]:
            if getattr(self, name) is None:
                raise FieldRefused(f"{where}{name} is required in a {self.type} block",
                                   where + name)  # fmt: skip
        super().check_fields(unknown, where)

    def result_text(self) -> str:
        if isinstance(self.content, list):
            return "".join(b.text or "" for b in self.content if b.type == "text")
        return self.content or ""


class Message(Body):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Tool(Body):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: str | None = None
    strict: bool | None = None
    cache_control: CacheHint = None
    defer_loading: Any = None
    eager_input_streaming: Any = None  # how the stream splits the input: ours sends it whole
    input_examples: Any = None
    allowed_callers: Any = None
    NOT_IMPLEMENTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "defer_loading": (False,), "input_examples": (), "allowed_callers": ()}  # fmt: skip

    def check_fields(self, unknown: str = "refuse", where: str = "") -> None:
        if self.type not in (None, "custom"):
            raise FieldRefused(f"{where}type: tool type {self.type!r} is not supported by this "
                               "server (custom tools only; server tools such as web search, "
                               "bash or a text editor are not)", where + "type")  # fmt: skip
        super().check_fields(unknown, where)

    def chat(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            fn["description"] = self.description
        if self.strict is not None:
            fn["strict"] = self.strict
        return {"type": "function", "function": fn}


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    def check_fields(self, unknown: str = "refuse", where: str = "") -> None:
        if self.type == "tool" and not self.name:
            raise FieldRefused(f"{where}name is required with type 'tool'", where + "name")
        super().check_fields(unknown, where)

    def chat(self) -> Any:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class Thinking(Body):
    type: str
    budget_tokens: Any = None
    display: Any = None

    def check_fields(self, unknown: str = "refuse", where: str = "") -> None:
        if self.type != "disabled":
            raise FieldRefused(f"thinking {self.type!r} is not supported by this server "
                               "(only 'disabled')", "thinking")  # fmt: skip
        super().check_fields(unknown, where)


class OutputFormat(Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Body):
    format: OutputFormat | None = None
    effort: Any = None
    NOT_IMPLEMENTED: ClassVar[dict[str, tuple[Any, ...]]] = {"effort": ()}


class Metadata(Body):
    user_id: str | None = None


class CountTokensIn(Body):
    """A `/v1/messages/count_tokens` body: what renders the prompt."""

    messages: list[Message] = Field(min_length=1)
    model: str | None = None
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheHint = None
    speed: Any = None
    output_format: Any = None
    NOT_IMPLEMENTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "speed": ("standard",), "output_format": ()}  # fmt: skip

    def check_fields(self, unknown: str = "refuse", where: str = "") -> None:
        super().check_fields(unknown, where)
        if isinstance(self.system, list) and any(b.type != "text" for b in self.system):
            raise FieldRefused("system: only text blocks are allowed", "system")

    def to_chat(self) -> dict[str, Any]:
        """The chat completions body of this request (call check_fields first)."""
        chat: dict[str, Any] = {"messages": chat_messages(self.system, self.messages)}
        if self.tools:
            chat["tools"] = [t.chat() for t in self.tools]
        choice = self.tool_choice
        if choice is not None and self.tools:
            chat["tool_choice"] = choice.chat()
            if choice.disable_parallel_tool_use and choice.type != "none":
                chat["parallel_tool_calls"] = False
        elif choice is not None and choice.type != "none":
            raise FieldRefused("tool_choice needs tools", "tool_choice")
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is not None:
            chat["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": fmt.schema_}}  # fmt: skip
        if chat["messages"][-1]["role"] == "assistant":  # Anthropic's prefill: continue it
            chat |= {"add_generation_prompt": False, "continue_final_message": True}
        return chat


class MessagesIn(CountTokensIn):
    """A `POST /v1/messages` body."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here: both mean it
    # extensions: the PD router's fields and sglang's request id
    rid: str | None = None
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None
    # known, not implemented
    container: Any = None
    diagnostics: Any = None
    inference_geo: Any = None
    mcp_servers: Any = None
    context_management: Any = None
    NOT_IMPLEMENTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        **CountTokensIn.NOT_IMPLEMENTED,
        "container": (), "diagnostics": (), "inference_geo": (), "mcp_servers": (),
        "context_management": ()}  # fmt: skip

    def check_fields(self, unknown: str = "refuse", where: str = "") -> None:
        super().check_fields(unknown, where)
        if self.max_tokens < 1:
            raise FieldRefused("max_tokens must be at least 1 (this server keeps no prompt "
                               "cache to warm)", "max_tokens")  # fmt: skip

    def to_chat(self) -> dict[str, Any]:
        chat = super().to_chat()
        for name, value in (("max_tokens", self.max_tokens), ("stop", self.stop_sequences),
                            ("temperature", self.temperature), ("top_p", self.top_p),
                            ("top_k", self.top_k), ("rid", self.rid),
                            ("bootstrap_host", self.bootstrap_host),
                            ("bootstrap_port", self.bootstrap_port),
                            ("bootstrap_room", self.bootstrap_room)):  # fmt: skip
            if value is not None:
                chat[name] = value
        chat["stream"] = self.stream
        return chat


# chat field -> the Messages field a refusal names
RENAMES = {"stop": "stop_sequences", "response_format.json_schema": "output_config.format",
           "response_format": "output_config.format",
           "continue_final_message": "messages",
           "parallel_tool_calls": "tool_choice.disable_parallel_tool_use"}  # fmt: skip


def chat_messages(
    system: str | list[Block] | None, messages: list[Message]
) -> list[dict[str, Any]]:
    """The chat messages: the system prompt first, each tool_result a `tool` message (before
    the rest of its user turn), an assistant turn's tool_use blocks its tool_calls."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text(system)})
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "assistant":
            out.append(_assistant(m.content))
        else:
            out += _user(m.role, m.content, f"messages.{i}.content")
    return out


def _text(content: str | list[Block]) -> str:
    return content if isinstance(content, str) else "".join(b.text or "" for b in content)


def _assistant(blocks: list[Block]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant",
                           "content": "".join(b.text or "" for b in blocks if b.type == "text")}  # fmt: skip
    calls = [{"id": b.id, "type": "function",
              "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in blocks if b.type == "tool_use"]  # fmt: skip
    if calls:
        msg["tool_calls"] = calls
    thinking = "".join(b.thinking or "" for b in blocks if b.type == "thinking")
    if thinking:
        msg["reasoning_content"] = thinking
    return msg


def _user(role: str, blocks: list[Block], where: str) -> list[dict[str, Any]]:
    out = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.result_text()}
           for b in blocks if b.type == "tool_result"]  # fmt: skip
    for j, b in enumerate(blocks):
        if b.type not in ("text", "tool_result") or (role == "system" and b.type != "text"):
            raise FieldRefused(f"{where}.{j}.type: a {role} turn may not hold a {b.type} block",
                               f"{where}.{j}.type")  # fmt: skip
    text = [b.text or "" for b in blocks if b.type == "text"]
    if text or not out:
        out.append({"role": role, "content": "".join(text)})
    return out
