"""The Responses and Messages APIs through the real, unmodified `openai` and `anthropic`
clients, on a frontend process with the fake engine (tests/fake_engine.py: it echoes
the prompt, so each answer is known exactly; the tool-calling round trips on a real
model are tests/test_real_qwen_agents.py).

The field tests read every parameter of the installed clients' `responses.create` and
`messages.create` with `inspect.signature`: each one sent alone either changes the
answer as it specifies or is a 400 naming it. A parameter a new client version adds
fails `test_every_client_field_has_a_case` until it gets a case here and a decision in
the server.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic.resources.messages import Messages
from fake_engine import ServerProc, make_model_dir
from openai.resources.responses import Responses

from pdserve.server.tokenizer import Tokenizer

MODEL = "tiny-test"
PROMPT = "Hello world"
MAX = 5
KEY = "sk-agents"
NOT_FIELDS = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}
REFUSED = "refused"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    return make_model_dir(tmp_path_factory.mktemp("model"), max_positions=256)


@pytest.fixture(scope="module")
def tok(model) -> Tokenizer:
    return Tokenizer(model)


@pytest.fixture(scope="module")
def server(model) -> Iterator[ServerProc]:
    s = ServerProc(model, "decode", "--served-model-name", MODEL, "--api-key", KEY)
    try:
        yield s.wait_healthy()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def oa(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def an(server) -> anthropic.Anthropic:  # sends the key as x-api-key
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=30)


def echo(tok: Tokenizer, messages: list[dict[str, str]], n: int = MAX) -> str:
    """The fake engine's answer to a chat: the rendered prompt's first n tokens."""
    ids = tok.encode(tok.apply_chat_template(messages), False)
    return tok.decode([ids[i % len(ids)] for i in range(n)])


def user(text: str = PROMPT) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def last(server: ServerProc, name: str) -> float:
    info = httpx.get(server.url + "/server_info", headers={"authorization": f"Bearer {KEY}"})
    return info.json()[f"last_{name}"]


def fields(create: Callable[..., Any]) -> list[str]:
    return [p for p in inspect.signature(create).parameters if p not in NOT_FIELDS]


# ---- the Responses API -------------------------------------------------------------------
class R:
    """Checks of a `responses.create` answer (or its list of stream events)."""

    @staticmethod
    def baseline(r: Any, tok: Tokenizer, server: ServerProc) -> None:
        assert r.output_text == echo(tok, user())

    @staticmethod
    def engine(name: str, want: float) -> Callable[..., None]:
        def check(r: Any, tok: Tokenizer, server: ServerProc) -> None:
            R.baseline(r, tok, server)
            assert last(server, name) == want

        return check


def _instructions(r: Any, tok: Tokenizer, server: ServerProc) -> None:
    assert r.output_text == echo(tok, [{"role": "system", "content": "Be brief"}, *user()])
    assert r.instructions == "Be brief"


def _max_output_3(r: Any, tok: Tokenizer, server: ServerProc) -> None:
    assert r.output_text == echo(tok, user(), 3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def _input(r: Any, tok: Tokenizer, server: ServerProc) -> None:
    assert r.output_text == echo(tok, user("other words"))


def _streamed(events: list[Any], tok: Tokenizer, server: ServerProc) -> None:
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == echo(tok, user())
    assert events[-1].response.output_text == text


def _metadata(r: Any, tok: Tokenizer, server: ServerProc) -> None:
    R.baseline(r, tok, server)
    assert r.metadata == {"team": "a"}


def _same(r: Any, tok: Tokenizer, server: ServerProc) -> None:
    R.baseline(r, tok, server)


FN = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": False}
RESPONSES: dict[str, tuple[Any, Any]] = {
    "access_programs": ({"cyber": "standard"}, REFUSED),
    "background": (True, REFUSED),
    "background_options": ({"completion_window": "2h"}, REFUSED),
    "context_management": ([{"type": "compaction"}], REFUSED),
    "conversation": ("conv_1", REFUSED),
    "image": ({"context_compression": "auto"}, REFUSED),
    "include": (["message.output_text.logprobs"], REFUSED),
    "input": ("other words", _input),
    "instructions": ("Be brief", _instructions),
    "max_output_tokens": (3, _max_output_3),
    "max_tool_calls": (1, REFUSED),
    "metadata": ({"team": "a"}, _metadata),
    "model": (MODEL, _same),
    "moderation": ({"model": "omni-moderation-latest"}, REFUSED),
    "parallel_tool_calls": (True, _same),  # with tools: tests/test_real_qwen_agents.py
    "previous_response_id": ("resp_1", REFUSED),
    "prompt": ({"id": "pmpt_1"}, REFUSED),
    "prompt_cache_key": ("k", _same),
    "prompt_cache_options": ({"ttl": "12h"}, REFUSED),
    "prompt_cache_retention": ("24h", REFUSED),
    "reasoning": ({"effort": "low"}, REFUSED),
    "safety_identifier": ("s-1", _same),
    "service_tier": ("priority", REFUSED),
    "store": (True, REFUSED),
    "stream": (True, _streamed),
    "stream_options": ({"include_obfuscation": False}, REFUSED),  # alone: needs stream
    "temperature": (0.25, R.engine("temperature", 0.25)),
    # enforced by the engine's grammar: tests/test_openai_structured.py
    "text": (
        {"format": {"type": "json_schema", "name": "o", "schema": {"type": "object"}}},
        R.engine("grammar", 1),
    ),  # fmt: skip
    "tool_choice": ({"type": "function", "name": "f"}, REFUSED),  # alone: needs tools
    "tools": ([FN], REFUSED),  # this model's template shows no tool-call format
    "top_logprobs": (2, REFUSED),
    "top_p": (0.5, R.engine("top_p", 0.5)),
    "truncation": ("auto", REFUSED),
    "user": ("user-1", _same),
}


def responses_call(oa: openai.OpenAI, field: str, value: Any) -> Any:
    kw: dict[str, Any] = {"model": MODEL, "input": PROMPT, "max_output_tokens": MAX,
                          field: value}  # fmt: skip
    out = oa.responses.create(**kw)
    return list(out) if kw.get("stream") else out


def test_every_client_field_has_a_case() -> None:
    cases = {
        "responses.create": (Responses.create, RESPONSES),
        "messages.create": (Messages.create, MESSAGES),
    }
    for name, (create, table) in cases.items():
        missing = sorted(set(fields(create)) - set(table))
        assert not missing, f"{name}: client fields with no decision: {missing}"


R_FIELDS = fields(Responses.create)


@pytest.mark.parametrize("field", R_FIELDS)
def test_responses_field(oa, tok, server, field) -> None:
    if field not in RESPONSES:
        pytest.fail(f"no case for the openai client's new field {field!r}")
    value, check = RESPONSES[field]
    if check == REFUSED:
        with pytest.raises(openai.BadRequestError) as e:
            responses_call(oa, field, value)
        assert (e.value.param or "").split(".")[0] == field, e.value.body
        assert field in str(e.value.message)
        return
    check(responses_call(oa, field, value), tok, server)


def test_responses_stream_event_sequence(oa, tok) -> None:
    events = list(oa.responses.create(model=MODEL, input=PROMPT, max_output_tokens=MAX,
                                      stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete",  # max_output_tokens cut it (as OpenAI: status incomplete)
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.usage.output_tokens == MAX and final.output[0].content[0].text == echo(tok, user())


def test_responses_input_items_become_the_chat_messages(oa, tok) -> None:
    """Messages, a function call and its output, in the chat messages they stand for."""
    items = [
        {"role": "developer", "content": "Be brief"},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    r = oa.responses.create(model=MODEL, input=items, max_output_tokens=40)
    chat = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": ""}, {"role": "tool", "content": "sunny"}]  # fmt: skip
    assert r.output_text == echo(tok, chat, 40)


def test_responses_refuse_by_name(server) -> None:
    h = {"authorization": f"Bearer {KEY}"}
    cases = {
        "input.0.type": {"input": [{"type": "input_image", "image_url": "x"}]},
        "input.0.content.0.type": {
            "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]
        },  # fmt: skip
        "tools.0.type": {"input": "hi", "tools": [{"type": "web_search"}]},
        "frobnicate": {"input": "hi", "frobnicate": 1},
        # a streamed request's parameters are checked before its stream starts
        "temperature": {"input": "hi", "stream": True, "temperature": -1},
    }
    for param, body in cases.items():
        r = httpx.post(server.url + "/v1/responses", json=body, headers=h, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.get(server.url + "/v1/responses/resp_1", headers=h, timeout=30)
    assert r.status_code == 404 and "does not store" in r.json()["error"]["message"]


# ---- the Messages API --------------------------------------------------------------------
def M_base(r: Any, tok: Tokenizer, server: ServerProc) -> None:
    assert [b.type for b in r.content] == ["text"]
    assert r.content[0].text == echo(tok, user())
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == MAX


def _m_engine(name: str, want: float) -> Callable[..., None]:
    def check(r: Any, tok: Tokenizer, server: ServerProc) -> None:
        M_base(r, tok, server)
        assert last(server, name) == want

    return check


def _m_max_3(r: Any, tok: Tokenizer, server: ServerProc) -> None:
    assert r.content[0].text == echo(tok, user(), 3) and r.usage.output_tokens == 3


def _m_messages(r: Any, tok: Tokenizer, server: ServerProc) -> None:
    assert r.content[0].text == echo(tok, user("other words"))


def _m_stop(r: Any, tok: Tokenizer, server: ServerProc) -> None:
    full = echo(tok, user(), 50)
    assert r.content[0].text == full[: full.index("er")]
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "er"


def _m_system(r: Any, tok: Tokenizer, server: ServerProc) -> None:
    assert r.content[0].text == echo(tok, [{"role": "system", "content": "Be brief"}, *user()])


def _m_stream(events: list[Any], tok: Tokenizer, server: ServerProc) -> None:
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == echo(tok, user())


MESSAGES: dict[str, tuple[Any, Any]] = {
    "max_tokens": (3, _m_max_3),
    "messages": (user("other words"), _m_messages),
    "model": (MODEL, M_base),
    "cache_control": ({"type": "ephemeral"}, M_base),  # the prefix cache needs no marker
    "container": ("container_1", REFUSED),
    "diagnostics": ({"previous_message_id": "msg_1"}, REFUSED),
    "inference_geo": ("us", REFUSED),
    "metadata": ({"user_id": "u-1"}, M_base),
    "output_config": (
        {"format": {"type": "json_schema", "schema": {"type": "object"}}},
        _m_engine("grammar", 1),
    ),  # fmt: skip
    "service_tier": ("standard_only", M_base),  # one tier here: both values mean it
    "speed": ("fast", REFUSED),
    "stop_sequences": (["er"], _m_stop),
    "stream": (True, _m_stream),
    "system": ("Be brief", _m_system),
    "thinking": ({"type": "enabled", "budget_tokens": 1024}, REFUSED),
    "tool_choice": ({"type": "any"}, REFUSED),  # alone: needs tools
    "tools": ([{"name": "f", "input_schema": {"type": "object"}}], REFUSED),  # no tool format
    "user_profile_id": ("up-1", M_base),  # sent as a header: identifies the caller only
    "workspace_id": ("ws-1", M_base),  # sent as a header: identifies the caller only
}
M_FIELDS = fields(Messages.create)


def messages_call(an: anthropic.Anthropic, field: str, value: Any) -> Any:
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": MAX, "messages": user(), field: value}
    if field == "stop_sequences":
        kw["max_tokens"] = 50
    out = an.messages.create(**kw)
    return list(out) if kw.get("stream") else out


@pytest.mark.parametrize("field", M_FIELDS)
def test_messages_field(an, tok, server, field) -> None:
    if field not in MESSAGES:
        pytest.fail(f"no case for the anthropic client's new field {field!r}")
    value, check = MESSAGES[field]
    if check == REFUSED:
        with pytest.raises(anthropic.BadRequestError) as e:
            messages_call(an, field, value)
        assert e.value.body["type"] == "error", e.value.body
        assert e.value.body["error"]["type"] == "invalid_request_error"
        assert field in e.value.body["error"]["message"]
        return
    check(messages_call(an, field, value), tok, server)


def test_messages_sampling_fields_of_older_clients(an, server) -> None:
    """temperature / top_p / top_k: no longer in the client's signature, still sent by
    older clients and Claude Code."""
    an.messages.create(model=MODEL, max_tokens=MAX, messages=user(),
                       extra_body={"temperature": 0.25, "top_p": 0.5, "top_k": 3})  # fmt: skip
    assert (last(server, "temperature"), last(server, "top_p"), last(server, "top_k")) == (
        0.25, 0.5, 3)  # fmt: skip


def test_messages_stream_event_sequence(server, tok) -> None:
    body = {"model": MODEL, "max_tokens": MAX, "messages": user(), "stream": True}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEY},
                      timeout=30) as r:  # fmt: skip
        assert r.status_code == 200
        lines = list(r.iter_lines())
    names = [ln[7:] for ln in lines if ln.startswith("event: ")]
    data = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]
    assert [d["type"] for d in data] == names
    deltas = names.count("content_block_delta")
    assert names == ["message_start", "ping", "content_block_start",
                     *["content_block_delta"] * deltas, "content_block_stop", "message_delta",
                     "message_stop"]  # fmt: skip
    assert data[-2]["delta"]["stop_reason"] == "max_tokens"
    assert data[-2]["usage"]["output_tokens"] == MAX


def test_messages_stream_with_the_client(an, tok) -> None:
    with an.messages.stream(model=MODEL, max_tokens=MAX, messages=user()) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == echo(tok, user()) == final.content[0].text


def test_count_tokens_is_the_prompt_the_route_runs(an, tok) -> None:
    n = an.messages.count_tokens(model=MODEL, messages=user(), system="Be brief").input_tokens
    msgs = [{"role": "system", "content": "Be brief"}, *user()]
    assert n == len(tok.encode(tok.apply_chat_template(msgs), False))
    r = an.messages.create(model=MODEL, max_tokens=MAX, messages=user(), system="Be brief")
    assert r.usage.input_tokens == n


def test_messages_errors_have_anthropics_shape(server) -> None:
    url = server.url + "/v1/messages"
    ok = {"model": MODEL, "max_tokens": MAX, "messages": user()}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    cases = [
        ({"x-api-key": "wrong"}, ok, 401, "authentication_error"),
        ({}, ok, 401, "authentication_error"),
        ({"x-api-key": KEY}, {**ok, "model": "claude-x"}, 404, "not_found_error"),
        # a streamed request's parameters are checked before its stream starts
        ({"x-api-key": KEY}, {**ok, "stream": True, "top_p": 7}, 400, "invalid_request_error"),
        (
            {"x-api-key": KEY},
            {k: v for k, v in ok.items() if k != "max_tokens"},
            400,
            "invalid_request_error",
        ),  # fmt: skip
        (
            {"x-api-key": KEY},
            {**ok, "messages": [{"role": "user", "content": [image]}]},
            400,
            "invalid_request_error",
        ),  # fmt: skip
    ]
    for headers, body, status, kind in cases:
        r = httpx.post(url, json=body, headers=headers, timeout=30)
        assert r.status_code == status, r.text
        assert r.json() == {"type": "error", "error": {"type": kind,
                                                       "message": r.json()["error"]["message"]}}  # fmt: skip
    assert "image" in httpx.post(url, json=cases[-1][1], headers={"x-api-key": KEY}).text
    # the OpenAI routes take x-api-key too
    chat = {"model": MODEL, "max_tokens": 1, "messages": user()}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, headers={"x-api-key": KEY})
    assert r.status_code == 200, r.text


def test_messages_tool_blocks_become_the_chat_messages(an, tok) -> None:
    """An assistant tool_use turn and its tool_result, as the chat messages they stand for."""
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "t1", "name": "w", "input": {"x": 1}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sunny"}]},
            {"type": "text", "text": "And?"}]},
    ]  # fmt: skip
    r = an.messages.create(model=MODEL, max_tokens=60, messages=messages)
    chat = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Let me look."},
            {"role": "tool", "content": "sunny"}, {"role": "user", "content": "And?"}]  # fmt: skip
    assert r.content[0].text == echo(tok, chat, 60)
