"""The input items of a `POST /v1/responses` body (responses_api.py) and the chat
messages they stand for: messages, function calls and their outputs, reasoning; any
other item or content part type is refused by name."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from pdserve.server.http_util import parse
from pdserve.server.jobs import RequestError
from pdserve.server.request_fields import Body, FieldRefused, short_repr


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


def parse_item(raw: Any, where: str) -> Item:
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
