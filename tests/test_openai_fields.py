"""Every field the installed `openai` client can send is implemented or refused by name.

The field lists come from `inspect.signature` of the client's `completions.create` and
`chat.completions.create`, so a field a new client version adds fails this test until
it gets a case here (and a decision in the server). Each field is sent alone with a
value other than its default, through the client, to a real frontend process with the
fake engine (tests/fake_engine.py: it echoes the prompt, output token i = prompt[i %
len], logprob -(i+1)/10, and reports the numeric sampling parameters it was sent):
the answer either changes as the field specifies or is a 400 naming the field.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from fake_engine import ServerProc, make_model_dir

from pdserve.server.tokenizer import Tokenizer

MODEL = "tiny-test"
PROMPT = "Hello world"
MAX = 5
NOT_FIELDS = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    return make_model_dir(tmp_path_factory.mktemp("model"), max_positions=256)


@pytest.fixture(scope="module")
def tok(model) -> Tokenizer:
    return Tokenizer(model)


@pytest.fixture(scope="module")
def server(model) -> Iterator[ServerProc]:
    s = ServerProc(model, "decode", "--served-model-name", MODEL)
    try:
        yield s.wait_healthy()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def fields(create: Callable[..., Any]) -> list[str]:
    return [p for p in inspect.signature(create).parameters if p not in NOT_FIELDS]


def echo_text(tok: Tokenizer, ids: list[int], n: int) -> str:
    return tok.decode([ids[i % len(ids)] for i in range(n)])


def chat_ids(tok: Tokenizer, content: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": content}]), False)


def last(server: ServerProc, name: str) -> float:
    return httpx.get(server.url + "/server_info").json()[f"last_{name}"]


# A case is (value, check): `check(result, ctx)` asserts what the field specifies, with
# `result` the client's answer (or stream as a list of chunks). REFUSED: a 400 naming it.
REFUSED = "refused"
Case = tuple[Any, Callable[[Any, "Ctx"], None] | str]


class Ctx:
    def __init__(self, tok: Tokenizer, server: ServerProc, kind: str) -> None:
        self.tok, self.server, self.kind = tok, server, kind

    @property
    def prompt_ids(self) -> list[int]:
        return self.tok.encode(PROMPT) if self.kind == "completion" else chat_ids(self.tok, PROMPT)

    def text(self, choice: Any) -> str:
        return choice.text if self.kind == "completion" else choice.message.content

    def baseline(self, r: Any) -> None:
        """The answer without the field: the echo of the prompt, MAX tokens."""
        assert self.text(r.choices[0]) == echo_text(self.tok, self.prompt_ids, MAX)


def same_as_baseline(r: Any, c: Ctx) -> None:
    """Identifier and bookkeeping fields: by their definition they change nothing."""
    c.baseline(r)


def reaches_engine(name: str, want: float) -> Callable[[Any, Ctx], None]:
    def check(r: Any, c: Ctx) -> None:
        c.baseline(r)  # the fake ignores sampling; tests/test_sampling.py covers its effect
        assert last(c.server, name) == want

    return check


def n_choices(r: Any, c: Ctx) -> None:
    assert sorted(ch.index for ch in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 2 * MAX
    assert r.usage.prompt_tokens == len(c.prompt_ids)  # counted once, whatever n


def max_tokens_3(r: Any, c: Ctx) -> None:
    assert c.text(r.choices[0]) == echo_text(c.tok, c.prompt_ids, 3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def stop_at(word: str) -> Callable[[Any, Ctx], None]:
    def check(r: Any, c: Ctx) -> None:
        full = echo_text(c.tok, c.prompt_ids, 50)
        assert c.text(r.choices[0]) == full[: full.index(word)]
        assert r.choices[0].finish_reason == "stop"

    return check


def streamed(r: Any, c: Ctx) -> None:
    if c.kind == "completion":
        text = "".join(x.choices[0].text for x in r if x.choices)
    else:
        text = "".join(x.choices[0].delta.content or "" for x in r if x.choices)
    assert text == echo_text(c.tok, c.prompt_ids, MAX)


def usage_chunk(r: Any, c: Ctx) -> None:
    streamed(r, c)
    assert r[-1].choices == [] and r[-1].usage.completion_tokens == MAX


def other_model(r: Any, c: Ctx) -> None:
    raise AssertionError("a model the server does not serve must be a 404")


COMMON: dict[str, Case] = {
    "model": (MODEL, same_as_baseline),
    "frequency_penalty": (0.5, reaches_engine("frequency_penalty", 0.5)),
    "presence_penalty": (-0.5, reaches_engine("presence_penalty", -0.5)),
    "logit_bias": ({"5": 10}, reaches_engine("logit_bias.5", 10)),
    "max_tokens": (3, max_tokens_3),
    "n": (2, n_choices),
    "seed": (7, reaches_engine("seed", 7)),
    "stream": (True, streamed),
    "stream_options": ({"include_usage": True}, usage_chunk),
    "temperature": (0.25, reaches_engine("temperature", 0.25)),
    "top_p": (0.5, reaches_engine("top_p", 0.5)),
    "user": ("user-1", same_as_baseline),
}


def completion_logprobs(r: Any, c: Ctx) -> None:
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([-(i + 1) / 10 for i in range(MAX)])
    assert "".join(lp.tokens) == r.choices[0].text
    assert max(len(t) for t in lp.top_logprobs) == 2  # the top 2 (the fake's first is the token)


def echoed(r: Any, c: Ctx) -> None:
    assert r.choices[0].text == PROMPT + echo_text(c.tok, c.prompt_ids, MAX)
    assert r.choices[0].logprobs is None


COMPLETION: dict[str, Case] = {
    **COMMON,
    "prompt": ("other words", lambda r, c: None),  # checked by the test itself
    "stop": ([" world"], stop_at(" world")),
    "best_of": (2, REFUSED),
    "echo": (True, echoed),  # with logprobs: tests/test_openai_logprobs.py (SmolLM2)
    "logprobs": (2, completion_logprobs),
    "suffix": (" the end", REFUSED),
}


def chat_logprobs(r: Any, c: Ctx) -> None:
    lps = [x.logprob for x in r.choices[0].logprobs.content]
    assert lps == pytest.approx([-(i + 1) / 10 for i in range(MAX)])


def chat_top_logprobs(r: Any, c: Ctx) -> None:
    chat_logprobs(r, c)
    for x in r.choices[0].logprobs.content:
        assert [t.token for t in x.top_logprobs][:1] == [x.token] and len(x.top_logprobs) == 2


CHAT: dict[str, Case] = {
    **COMMON,
    "messages": ([{"role": "user", "content": "other words"}], lambda r, c: None),
    "stop": (["er"], stop_at("er")),
    "audio": ({"voice": "alloy", "format": "wav"}, REFUSED),
    "function_call": ("auto", REFUSED),
    "functions": ([{"name": "f", "parameters": {"type": "object"}}], REFUSED),
    "logprobs": (True, chat_logprobs),
    "max_completion_tokens": (3, max_tokens_3),
    "metadata": ({"team": "a"}, same_as_baseline),
    "modalities": (["text", "audio"], REFUSED),
    "moderation": ({"model": "omni-moderation-latest"}, REFUSED),
    # with no tools it changes nothing (OpenAI's default is true); with tools, one call at
    # most: tests/test_openai_tools.py, tests/test_real_qwen_tools.py
    "parallel_tool_calls": (False, same_as_baseline),
    "prediction": ({"type": "content", "content": "Hello"}, REFUSED),
    "prompt_cache_key": ("k", same_as_baseline),
    "prompt_cache_options": ({"ttl": "1h"}, REFUSED),
    "prompt_cache_retention": ("24h", REFUSED),
    "reasoning_effort": ("low", REFUSED),
    # enforced by the engine's grammar: tests/test_openai_structured.py (SmolLM2)
    "response_format": ({"type": "json_object"}, reaches_engine("grammar", 1)),
    "safety_identifier": ("s-1", same_as_baseline),
    "service_tier": ("flex", REFUSED),
    "store": (True, REFUSED),
    "tool_choice": ("required", REFUSED),
    "tools": ([{"type": "function", "function": {"name": "f", "parameters": {}}}], REFUSED),
    "top_logprobs": (2, chat_top_logprobs),  # with logprobs (alone: a 400 naming it)
    "verbosity": ("low", REFUSED),
    "web_search_options": ({}, REFUSED),
}


ALSO = {
    "stream_options": {"stream": True},
    "top_logprobs": {"logprobs": True},
}  # fields that need another one


def call(client: openai.OpenAI, kind: str, field: str, value: Any) -> Any:
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": MAX, field: value, **ALSO.get(field, {})}
    if kind == "completion":
        kw.setdefault("prompt", PROMPT)
        out = client.completions.create(**kw)
    else:
        kw.setdefault("messages", [{"role": "user", "content": PROMPT}])
        if field == "max_completion_tokens":
            del kw["max_tokens"]
        out = client.chat.completions.create(**kw)
    return list(out) if kw.get("stream") else out


SIGNATURES = {
    "completion": (openai.resources.completions.Completions.create, COMPLETION),
    "chat": (openai.resources.chat.completions.Completions.create, CHAT),
}
ALL = [(k, f) for k, (create, _) in SIGNATURES.items() for f in fields(create)]


def test_every_client_field_has_a_case() -> None:
    for kind, (create, cases) in SIGNATURES.items():
        missing = sorted(set(fields(create)) - set(cases))
        assert not missing, f"{kind}: fields of the openai client with no decision: {missing}"


@pytest.mark.parametrize(("kind", "field"), ALL, ids=[f"{k}-{f}" for k, f in ALL])
def test_field_changes_the_output_or_is_refused(client, tok, server, kind, field) -> None:
    cases = SIGNATURES[kind][1]
    if field not in cases:
        pytest.fail(f"no case for the openai client's new field {field!r}")
    value, check = cases[field]
    ctx = Ctx(tok, server, kind)
    if check == REFUSED:
        with pytest.raises(openai.BadRequestError) as e:
            call(client, kind, field, value)
        assert e.value.param == field, e.value.body
        assert field in str(e.value.message)
        return
    r = call(client, kind, field, value)
    if field in ("prompt", "messages"):
        ids = tok.encode("other words") if kind == "completion" else chat_ids(tok, "other words")
        assert ctx.text(r.choices[0]) == echo_text(tok, ids, MAX)
        return
    assert callable(check)
    check(r, ctx)


def test_a_model_the_server_does_not_serve_is_a_404(client) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-17", prompt=PROMPT, max_tokens=MAX)
    assert e.value.param == "model"
