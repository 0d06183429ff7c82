"""The decode frontend's HTTP API against a real server process with the fake engine.

The fake engine echoes the prompt (output token i = prompt[i % len(prompt)],
logprob -(i+1)/10), so every expected text below is computed from the tokenizer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from fake_engine import FAIL_SEED, ServerProc, make_model_dir

from pdserve.server.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    return make_model_dir(tmp_path_factory.mktemp("model"), max_positions=256)


@pytest.fixture(scope="module")
def tok(model) -> Tokenizer:
    return Tokenizer(model)


@pytest.fixture(scope="module")
def server(model) -> Iterator[ServerProc]:
    s = ServerProc(model, "decode", "--served-model-name", "tiny-test", PDSERVE_FAKE_STEP_S="0.01")
    try:
        yield s.wait_healthy()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def echo(tok: Tokenizer, ids: list[int], n: int) -> tuple[list[int], str]:
    out = [ids[i % len(ids)] for i in range(n)]
    return out, tok.decode(out)


def info(server: ServerProc) -> dict:
    return httpx.get(server.url + "/server_info").json()


def sse_events(lines: Iterator[str]) -> list:
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---- OpenAI API through the official client ----------------------------------------------
def test_completion(client, tok):
    r = client.completions.create(model="tiny-test", prompt="Hello world", max_tokens=7)
    _, want = echo(tok, tok.encode("Hello world"), 7)
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(tok.encode("Hello world")), 7)


def test_completion_stream_matches_non_stream(client, tok):
    chunks = list(client.completions.create(model="tiny-test", prompt="héllo 😀 world",
                                            max_tokens=9, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    _, want = echo(tok, tok.encode("héllo 😀 world"), 9)
    assert text == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 9


def chat_ids(tok: Tokenizer, content: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": content}]), False)


def test_chat(client, tok):
    msgs = [{"role": "user", "content": "hi there"}]
    r = client.chat.completions.create(model="tiny-test", messages=msgs, max_tokens=6)
    _, want = echo(tok, chat_ids(tok, "hi there"), 6)
    assert r.choices[0].message.content == want
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(chat_ids(tok, "hi there"))


def test_chat_stream(client, tok):
    msgs = [{"role": "user", "content": "hi there"}]
    chunks = list(client.chat.completions.create(model="tiny-test", messages=msgs,
                                                 max_completion_tokens=6, stream=True))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == echo(tok, chat_ids(tok, "hi there"), 6)[1]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_samples_are_separate_engine_requests(client, server, tok):
    before = info(server)["added"]
    r = client.completions.create(model="tiny-test", prompt="Hello", max_tokens=3, n=2, seed=1)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.text == echo(tok, tok.encode("Hello"), 3)[1] for c in r.choices)
    assert r.usage.completion_tokens == 6
    assert info(server)["added"] - before == 2


def test_completion_logprobs(client, tok):
    r = client.completions.create(model="tiny-test", prompt="Hello world", max_tokens=4, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert "".join(lp.tokens) == r.choices[0].text


def test_chat_logprobs_stream(client):
    msgs = [{"role": "user", "content": "hey"}]
    chunks = client.chat.completions.create(model="tiny-test", messages=msgs, max_tokens=3,
                                            logprobs=True, stream=True)  # fmt: skip
    lps = [x.logprob for c in chunks if c.choices and c.choices[0].logprobs
           for x in c.choices[0].logprobs.content]  # fmt: skip
    assert lps == pytest.approx([-0.1, -0.2, -0.3])


def test_stop_string_cuts_output_and_stops_the_engine(client, server):
    before = info(server)["aborted"]
    r = client.completions.create(model="tiny-test", prompt="one two STOP three", max_tokens=50,
                                  stop=["STOP"])  # fmt: skip
    assert r.choices[0].text == "one two "
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 50
    assert info(server)["aborted"] == before + 1


# ---- native /generate ---------------------------------------------------------------------
def test_generate_native(server, tok):
    ids = tok.encode("Hello world")
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 5, "temperature": 0},
            "return_logprob": True, "rid": "native-1", "bootstrap_host": "127.0.0.1",
            "bootstrap_port": 1234, "bootstrap_room": 77}  # fmt: skip
    r = httpx.post(server.url + "/generate", json=body).json()
    out, text = echo(tok, ids, 5)
    assert (r["text"], r["output_ids"]) == (text, out)
    meta = r["meta_info"]
    assert meta["id"] == "native-1"
    assert meta["finish_reason"] == {"type": "length"}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(ids), 5)
    assert [x[0] for x in meta["output_token_logprobs"]] == pytest.approx([-0.1 * i for i in range(1, 6)])  # fmt: skip


def test_generate_native_stream_is_cumulative(server, tok):
    body = {"text": "a b c", "stream": True, "sampling_params": {"max_new_tokens": 4}}
    with httpx.stream("POST", server.url + "/generate", json=body) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    texts = [e["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == echo(tok, tok.encode("a b c"), 4)[1]
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "length"


def test_room_list_must_match_n(server):
    body = {"text": "x", "sampling_params": {"n": 2}, "bootstrap_room": [1, 2, 3]}
    r = httpx.post(server.url + "/generate", json=body)
    assert r.status_code == 400


def test_abort_request_endpoint(server):
    body = {"text": "long", "rid": "to-abort", "stream": True, "sampling_params": {"max_new_tokens": 200}}  # fmt: skip
    with httpx.stream("POST", server.url + "/generate", json=body) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert (
            httpx.post(server.url + "/abort_request", json={"rid": "to-abort"}).status_code == 200
        )
        events = sse_events(lines)
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(events[-2]["output_ids"]) < 200


def test_engine_error_is_a_500_never_a_200(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "seed": FAIL_SEED})
    assert r.status_code == 500
    assert "fake engine failure" in r.json()["error"]["message"]
    body = {"prompt": "x", "seed": FAIL_SEED, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as s:
        events = sse_events(s.iter_lines())
    assert "fake engine failure" in events[0]["error"]["message"]
    assert events[-1] == "[DONE]"


# ---- bad input ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, None),
        ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, None),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, None),
        ("/v1/completions", {"prompt": "word " * 300}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1000}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-17"}, 404, "model"),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/generate", {"sampling_params": {"max_new_tokens": 2}}, 400, "text"),
        ("/generate", {"input_ids": [10**6]}, 400, "prompt"),
        ("/v1/completions", b'{"prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}', 413, None),
    ],
)
def test_bad_input_gets_openai_error(server, path, body, status, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + path, **kw)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param
    assert httpx.get(server.url + "/health").status_code == 200


# ---- disconnects free the engine's resources ----------------------------------------------
def wait_idle_after_abort(server: ServerProc, aborted_before: float) -> dict:
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        s = info(server)
        if s["aborted"] > aborted_before and s["running"] == 0:
            return s
        time.sleep(0.05)
    raise AssertionError(f"engine did not see the abort: {info(server)}")


def test_client_disconnect_mid_stream_aborts(server):
    before = info(server)["aborted"]
    body = {"prompt": "go on", "max_tokens": 200, "stream": True}  # 200 steps: ~2 s
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    s = wait_idle_after_abort(server, before)
    assert s["free_rows"] == s["total_rows"]
    assert s["free_kv_pages"] == s["total_kv_pages"]
    assert s["in_flight"] == 0


def test_client_disconnect_non_stream_aborts(server):
    before = info(server)["aborted"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"prompt": "go", "max_tokens": 200},
                   timeout=0.5)  # fmt: skip
    s = wait_idle_after_abort(server, before)
    assert s["free_kv_pages"] == s["total_kv_pages"]


# ---- info endpoints ----------------------------------------------------------------------
def test_info_endpoints(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny-test"]
    mi = httpx.get(server.url + "/model_info").json()
    assert mi["is_generation"] is True and mi["model_path"]
    si = info(server)
    assert si["role"] == "decode" and si["engine_alive"] is True
    for key in ("free_rows", "total_rows", "free_kv_pages", "total_kv_pages", "running", "queued"):
        assert key in si
    assert httpx.get(server.url + "/get_server_info").json()["role"] == "decode"
    assert httpx.get(server.url + "/health_generate").status_code == 200


def test_metrics(server, client):
    client.completions.create(model="tiny-test", prompt="m", max_tokens=2)
    text = httpx.get(server.url + "/metrics").text
    for name in ("time_to_first_token_seconds_count", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_sum", "num_running_reqs", "num_prealloc_queue_reqs",
                 "num_transfer_queue_reqs", "kv_transfer_seconds_count",
                 "kv_transfer_bytes_total", "transfer_failed_total", "token_usage",
                 "forward_busy_ratio"):  # fmt: skip
        assert f"pdserve:{name}" in text
    ttft = next(x for x in text.splitlines() if x.startswith("pdserve:time_to_first_token_seconds_count"))  # fmt: skip
    assert float(ttft.split()[-1]) >= 1


def test_stats_endpoint_counts_what_was_served(server, client):
    """GET /stats (the router console's source): engine gauges and the frontend's counters."""
    before = httpx.get(server.url + "/stats").json()
    client.completions.create(model="tiny-test", prompt="s", max_tokens=3)
    after = httpx.get(server.url + "/stats").json()
    assert after["role"] == "decode" and after["engine_alive"] is True
    assert after["finished"] == before["finished"] + 1
    assert after["output_tokens"] == before["output_tokens"] + 3
    for key in ("free_rows", "total_rows", "free_kv_pages", "total_kv_pages", "running", "queued"):
        assert key in after["engine"]
    assert isinstance(after["recent"], list)


def test_unknown_route_and_wrong_method_in_the_openai_shape(server) -> None:
    """An OpenAI client shows `error.message`: it names the route (404) or the method (405)."""
    r = httpx.post(server.url + "/v1/messages", json={})
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "Invalid URL (POST /v1/messages): this server has "
                                  "no such route", "type": "invalid_request_error",
                                  "param": None, "code": 404}}  # fmt: skip
    r = httpx.delete(server.url + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["message"] == (
        "Method DELETE is not allowed on /v1/completions (allowed: POST)"
    )
