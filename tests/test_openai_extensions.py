"""The extensions and small routes around the OpenAI API, against a real frontend process
with the fake engine (it echoes the prompt: output token i = prompt[i % len(prompt)]).

The main server runs with `--chat-template FILE` (a template that shows tools, tool
messages and a template kwarg) and CORS for one origin; a second one with
`--max-queued-requests 0 --unknown-fields warn` (every request finds the queue full).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from fake_engine import ServerProc, make_model_dir

from pdserve.server.tokenizer import Tokenizer

MODEL = "tiny-test"
ORIGIN = "http://app.example"
TEMPLATE = (
    "{% if tools %}TOOLS{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n{% endif %}"
    "{% if greeting is defined %}{{ greeting }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'tool' %}[{{ m['tool_call_id'] }}] {% endif %}{{ m['content'] }}"
    "{% if not (loop.last and m['role'] == 'assistant') %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    return make_model_dir(tmp_path_factory.mktemp("model"), max_positions=256)


@pytest.fixture(scope="module")
def tok(model) -> Tokenizer:
    return Tokenizer(model)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory) -> Iterator[ServerProc]:
    template = tmp_path_factory.mktemp("tpl") / "t.jinja"
    template.write_text(TEMPLATE)
    s = ServerProc(model, "decode", "--served-model-name", MODEL, "--chat-template",
                   str(template), "--allowed-origins", ORIGIN)  # fmt: skip
    try:
        yield s.wait_healthy()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def post(server: ServerProc, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=10)


def rendered(server: ServerProc, body: dict) -> str:
    """The prompt the server renders for `body` (its /tokenize, then /detokenize)."""
    ids = post(server, "/tokenize", body).json()["tokens"]
    return post(server, "/detokenize", {"tokens": ids}).json()["prompt"]


def echo(tok: Tokenizer, ids: list[int], n: int) -> str:
    return tok.decode([ids[i % len(ids)] for i in range(n)])


# ---- /tokenize and /detokenize ------------------------------------------------------------
def test_tokenize_prompt(server, tok):
    r = post(server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256
    assert r["token_strs"] == [tok.hf.id_to_token(t) for t in r["tokens"]]
    assert post(server, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}


def test_tokenize_refuses_bad_input(server):
    r = post(server, "/detokenize", {"tokens": [10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = post(server, "/tokenize", {"prompt": "x", "bogus": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bogus"


def test_chat_uses_the_template_the_tokenizer_shows(client, server, tok):
    msgs = [{"role": "user", "content": "hi there"}]
    ids = post(server, "/tokenize", {"messages": msgs}).json()["tokens"]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40)
    assert r.choices[0].message.content == echo(tok, ids, 40)
    assert r.usage.prompt_tokens == len(ids)


# ---- chat template controls ----------------------------------------------------------------
def test_chat_template_file_and_kwargs(server):
    msgs = [{"role": "user", "content": "hi"}]
    text = rendered(server, {"messages": msgs, "chat_template_kwargs": {"greeting": "HELLO"}})
    assert text.startswith("HELLO\n") and text.endswith("assistant\n")
    # (detokenized without the special tokens: <|im_end|> is gone, its newline stays)
    assert rendered(server, {"messages": msgs, "add_generation_prompt": False}).endswith("hi\n")


def test_continue_final_message(server, client, tok):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello wor"}]
    body = {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True}
    assert rendered(server, body).endswith("assistant\nHello wor")
    r = post(server, "/v1/chat/completions", {**body, "max_tokens": 2})
    assert r.status_code == 200
    both = {"messages": msgs, "continue_final_message": True}  # add_generation_prompt stays on
    r = post(server, "/v1/chat/completions", both)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_text_parts_tools_and_tool_messages_reach_the_template(server):
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "wea"}, {"type": "text", "text": "ther?"}]},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]  # fmt: skip
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    text = rendered(server, {"messages": msgs, "tools": tools})
    assert text.startswith("TOOLS get_weather")
    assert "weather?" in text and "[c1] sunny" in text
    body = {"messages": msgs, "tools": tools, "tool_choice": "none", "max_tokens": 2}
    assert post(server, "/v1/chat/completions", body).status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages.0.content.0.type"),
        ({"messages": [{"role": "user", "content": "x", "colour": "red"}]}, "messages.0.colour"),
        ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": []}},
         "chat_template_kwargs"),
        ({"messages": [{"role": "user", "content": "x"}], "min_tokens": 2}, "min_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 3}, "frequency_penalty"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"x": 1}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"99999": 1}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": "x"}], "guided_grammar": "x"}, "guided_grammar"),
        ({"messages": [{"role": "user", "content": "x"}], "guided_json": {"type": "bogus"}},
         "guided_json"),
        ({"messages": [{"role": "user", "content": "x"}], "guided_regex": "a", "regex": "b"}, "regex"),
        ({"messages": [{"role": "user", "content": "x"}], "no_such_field": 1}, "no_such_field"),
        ({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}},
         "stream_options"),
    ],
)  # fmt: skip
def test_refused_by_name(server, body, param):
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_generate_sampling_params_refused_by_name(server):
    body = {"text": "x", "sampling_params": {"min_new_tokens": 3}}
    r = post(server, "/generate", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.min_new_tokens"
    body = {"text": "x", "sampling_params": {"max_new_tokens": 2}, "sglang_extra": 1}
    r = post(server, "/generate", body)  # the top level too: never ignored
    assert r.status_code == 400 and r.json()["error"]["param"] == "sglang_extra"
    body = {"text": "x", "sampling_params": {"max_new_tokens": 2}, "return_hidden_states": True}
    r = post(server, "/generate", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_hidden_states"
    # what sglang-router writes into every /generate body, at its defaults
    router_fields = {"model": None, "return_text_in_logprobs": False, "log_metrics": True,
                     "return_hidden_states": False, "background": False, "no_logs": False,
                     "return_bytes": False, "return_entropy": False}  # fmt: skip
    body = {"text": "x", "sampling_params": {"max_new_tokens": 2}, **router_fields}
    assert post(server, "/generate", body).status_code == 200
    body = {"text": "x", "sampling_params": {"regex": "a+"}}
    assert post(server, "/generate", body).status_code == 200
    assert httpx.get(server.url + "/server_info").json()["last_grammar"] == 1
    body = {"text": "x", "sampling_params": {"json_schema": '{"type": "bogus"}'}}
    r = post(server, "/generate", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "json_schema"
    body = {"text": "x", "sampling_params": {"ebnf": 'root ::= "a"+', "max_new_tokens": 2}}
    assert post(server, "/generate", body).status_code == 200  # sglang's EBNF grammar
    body = {"text": "x", "sampling_params": {"ebnf": "root ::= ("}}
    r = post(server, "/generate", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "ebnf"


# ---- extensions that change the output ----------------------------------------------------
def test_sampling_extensions_reach_the_engine(server):
    body = {
        "prompt": "Hello",
        "max_tokens": 2,
        "top_k": 3,
        "min_p": 0.25,
        "repetition_penalty": 1.25,
    }
    assert post(server, "/v1/completions", body).status_code == 200
    si = httpx.get(server.url + "/server_info").json()
    assert (si["last_top_k"], si["last_min_p"], si["last_repetition_penalty"]) == (3, 0.25, 1.25)
    body = {"text": "x", "sampling_params": {"max_new_tokens": 2, "presence_penalty": 0.5}}
    assert post(server, "/generate", body).status_code == 200
    assert httpx.get(server.url + "/server_info").json()["last_presence_penalty"] == 0.5


def test_stop_token_ids_and_ignore_eos(server, tok):
    ids = tok.encode("a b c d")
    r = post(
        server, "/v1/completions", {"prompt": ids, "max_tokens": 8, "stop_token_ids": [ids[2]]}
    )
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] == 3
    eos = tok.eos_token_ids[0]
    body = {"prompt": [*ids, eos], "max_tokens": 8}
    assert (
        post(server, "/v1/completions", body).json()["usage"]["completion_tokens"] == len(ids) + 1
    )
    r = post(server, "/v1/completions", {**body, "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == 8


def test_a_list_of_prompts(server, tok):
    body = {"prompt": ["one two", "three"], "max_tokens": 3, "n": 2}
    r = post(server, "/v1/completions", body).json()
    texts = {c["index"]: c["text"] for c in r["choices"]}
    want = [echo(tok, tok.encode(p), 3) for p in ("one two", "three")]
    assert texts == {0: want[0], 1: want[0], 2: want[1], 3: want[1]}
    assert r["usage"]["prompt_tokens"] == len(tok.encode("one two")) + len(tok.encode("three"))
    assert r["usage"]["completion_tokens"] == 12


def test_usage_with_n_streamed(server, tok):
    body = {"prompt": "Hello", "max_tokens": 3, "n": 3, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = [x for x in r.iter_lines() if x.startswith("data: {")]
    last = json.loads(lines[-1][6:])
    assert last["usage"] == {"prompt_tokens": len(tok.encode("Hello")), "completion_tokens": 9,
                             "total_tokens": len(tok.encode("Hello")) + 9}  # fmt: skip


# ---- CORS (opt-in) ----------------------------------------------------------------------
def test_cors_preflight_for_the_allowed_origin_only(server):
    head = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    r = httpx.options(server.url + "/v1/completions", headers=head)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.options(server.url + "/v1/completions", headers={**head, "Origin": "http://evil"})
    assert "access-control-allow-origin" not in r.headers


def test_no_cors_unless_asked(model):
    s = ServerProc(model, "decode", "--max-queued-requests", "0", "--unknown-fields", "warn")
    try:
        s.wait_healthy()
        head = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
        r = httpx.options(s.url + "/v1/completions", headers=head)
        assert "access-control-allow-origin" not in r.headers
        # a full queue: 503 with Retry-After, never a 500 (streamed: the error event's code)
        r = post(s, "/v1/completions", {"prompt": "x", "max_tokens": 2, "extra_thing": 1})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "queue is full" in r.json()["error"]["message"]
        r = post(s, "/generate", {"text": "x"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        with httpx.stream("POST", s.url + "/v1/completions",
                          json={"prompt": "x", "stream": True}) as st:  # fmt: skip
            event = next(x for x in st.iter_lines() if x.startswith("data: {"))
        assert '"code": 503' in event
    finally:
        s.stop()
