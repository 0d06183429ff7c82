"""End to end through `pdserve up`: router -> prefill -> ZeroMQ KV -> decode, real engines.

One stack (tiny model, small pools) serves every test of this module; greedy
tokens are checked against `transformers`, the oracle nobody here wrote.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import console_browser
import httpx
import openai
import pytest
from conftest import hf_greedy, model_path
from tokenizers import Tokenizer

NEW = 10  # greedy tokens per checked request
N_PROMPTS = 4  # distinct prompts; their references are computed while the stack starts
CHAT = [{"role": "user", "content": "Name three colours."}]
STARTUP_S = 180.0


@dataclass
class Stack:
    url: str  # the router
    prefill: str
    decode: str
    model: Path
    tok: Tokenizer
    refs: dict[tuple[int, ...], list[int]]  # prompt -> transformers' NEW greedy tokens
    name: str = ""  # the served model name, from /v1/models

    def ref(self, ids: list[int]) -> list[int]:
        key = tuple(ids)
        if key not in self.refs:
            self.refs[key] = hf_greedy(self.model, ids, NEW)
        return self.refs[key]

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(argv: list[str], log_name: str) -> subprocess.Popen:
    """A child in its own process group (so `stop` reaches everything it started)."""
    log = open(Path(tempfile.gettempdir()) / f"pdserve-e2e-{log_name}-{os.getpid()}.log", "w")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop(*procs: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM each child (its own shutdown stops what it started); SIGKILL whatever of
    its group is left after the grace period. NOTE: SIGTERM to a server's whole group
    would also hit its engine first, and the frontend then hangs in its shutdown."""
    for p in procs:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        _signal_group(p, signal.SIGKILL)
        p.wait(timeout=10)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def wait_healthy(url: str, procs: list[subprocess.Popen], timeout_s: float = STARTUP_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            assert p.poll() is None, f"{p.args!r} exited with {p.returncode}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} not healthy after {timeout_s} s")


def pool_args() -> list[str]:
    return ["--max-total-tokens", "8192", "--max-running-requests", "8"]


@pytest.fixture(scope="module")
def stack():
    model = model_path("tiny")
    port = free_port()
    # the decode drafts with the model itself (--speculative draft): every greedy answer
    # below is verified draft by draft, and still equals transformers'
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port),
            "--grace-period", "5", "--model", str(model), *pool_args(),
            "--speculative", "draft", "--draft-model", str(model)]  # fmt: skip
    proc = spawn(argv, "up")
    url = f"http://127.0.0.1:{port}"
    try:
        tok = Tokenizer.from_file(str(model / "tokenizer.json"))
        prompts = [prompt(tok, i) for i in range(N_PROMPTS)] + [chat_ids(model)]
        refs = {tuple(p): hf_greedy(model, p, NEW) for p in prompts}  # while the servers start
        wait_healthy(url, [proc])
        info = httpx.get(url + "/server_info", timeout=5).json()["router"]
        st = Stack(url, info["prefill"][0][0], info["decode"][0], model, tok, refs)
        st.name = st.client().models.list().data[0].id
        yield st
    finally:
        stop(proc)


def chat_ids(model: Path, messages: list[dict[str, str]] = CHAT) -> list[int]:
    """The chat prompt as transformers renders and tokenizes it."""
    import transformers

    hf_tok = transformers.AutoTokenizer.from_pretrained(str(model))
    text = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(hf_tok(text, add_special_tokens=False)["input_ids"])


def prompt(tok: Tokenizer, i: int) -> list[int]:
    """Prompts of different lengths (one spans several KV pages)."""
    text = f"Request {i}: the quick brown fox jumps over the lazy dog. " * (1 + i % 4)
    return tok.encode(text, add_special_tokens=False).ids


def generate(url: str, ids: list[int], **sp: object) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW, "temperature": 0, **sp}}
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def check_breakdown(b: object) -> None:
    assert isinstance(b, dict), b
    # prefill_queue and prefill come from the prefill's stamps, carried over the wire;
    # router from the router's header, frontend from the prefill frontend's stamp
    want = {"router", "frontend", "queue", "prefill_queue", "prefill", "kv_transfer"}
    want.add("decode_admission")
    assert want <= b.keys(), b
    assert all(isinstance(v, float) and v >= 0 for v in b.values()), b


def sse_objects(resp: httpx.Response) -> list[dict]:
    lines = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(x) for x in lines[:-1]]


# ---- greedy tokens equal transformers' --------------------------------------------------
def test_native_generate_matches_transformers(stack):
    for i in (0, 3):
        ids = prompt(stack.tok, i)
        out = generate(stack.url, ids)
        assert out["output_ids"] == stack.ref(ids)
        assert out["text"] == stack.text(out["output_ids"])
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        check_breakdown(out["meta_info"]["ttft_breakdown"])


def test_native_stream_matches_transformers(stack):
    ids = prompt(stack.tok, 1)
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": NEW, "temperature": 0}}  # fmt: skip
    with httpx.stream("POST", stack.url + "/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        chunks = sse_objects(r)
    assert chunks[-1]["output_ids"] == stack.ref(ids)  # cumulative
    check_breakdown(chunks[-1]["meta_info"]["ttft_breakdown"])


def test_openai_completion_token_prompt(stack):
    ids = prompt(stack.tok, 2)
    want = stack.text(stack.ref(ids))
    c = stack.client()
    r = c.completions.create(model=stack.name, prompt=[ids], max_tokens=NEW, temperature=0)
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == NEW
    assert r.usage.prompt_tokens == len(ids)
    check_breakdown((r.model_extra or {}).get("ttft_breakdown"))
    stream = c.completions.create(model=stack.name, prompt=[ids], max_tokens=NEW, temperature=0,
                                  stream=True)  # fmt: skip
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    check_breakdown((chunks[-1].model_extra or {}).get("ttft_breakdown"))


def test_openai_chat(stack):
    messages = CHAT
    ids = chat_ids(stack.model)
    want = stack.text(stack.ref(ids))
    c = stack.client()
    r = c.chat.completions.create(model=stack.name, messages=messages, max_tokens=NEW,  # type: ignore[arg-type]
                                  temperature=0)  # fmt: skip
    assert r.choices[0].message.content == want
    assert r.usage is not None and r.usage.prompt_tokens == len(ids)
    check_breakdown((r.model_extra or {}).get("ttft_breakdown"))
    chunks = list(c.chat.completions.create(model=stack.name, messages=messages,  # type: ignore[arg-type]
                                            max_tokens=NEW, temperature=0, stream=True))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n2_seeded_samples(stack):
    ids = prompt(stack.tok, 0)
    c = stack.client()

    def sample() -> list[str]:
        r = c.completions.create(model=stack.name, prompt=[ids], max_tokens=NEW, n=2, seed=7,
                                 temperature=1.0)  # fmt: skip
        assert sorted(ch.index for ch in r.choices) == [0, 1]
        assert r.usage is not None and r.usage.completion_tokens == 2 * NEW
        return [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]

    first = sample()
    assert first[0] != first[1]  # samples get seeds 7 and 8
    assert sample() == first  # and a seed makes them reproducible
    greedy = c.completions.create(model=stack.name, prompt=[ids], max_tokens=NEW, n=2,
                                  temperature=0)  # fmt: skip
    assert [ch.text for ch in greedy.choices] == [stack.text(stack.ref(ids))] * 2


def test_draft_model_drafts_through_pd(stack):
    """A greedy request alone on the decode is drafted by the draft model (here the model
    itself: every draft token accepted), and its tokens are transformers'."""
    before = server_info(stack.decode)
    ids = prompt(stack.tok, 3)
    assert generate(stack.url, ids)["output_ids"] == stack.ref(ids)
    after = server_info(stack.decode)
    drafted = after["spec_drafted_tokens"] - before["spec_drafted_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert drafted > 0 and accepted == drafted, (before, after)
    assert_all_free_soon(stack)


def test_concurrent_requests_match_transformers(stack):
    check_concurrent(stack, 8)


def check_concurrent(stack: Stack, n: int) -> None:
    """n requests, 8 at a time: each one's greedy tokens equal transformers'."""
    prompts = [prompt(stack.tok, i % N_PROMPTS) for i in range(n)]
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda ids: generate(stack.url, ids)["output_ids"], prompts))
    for ids, out in zip(prompts, outs):
        assert out == stack.ref(ids)


# ---- bad input: the right 4xx, an OpenAI-style body, and the servers carry on -----------
def bad_requests(ids: list[int]) -> list[tuple[str, object, int]]:
    """(path, body, status); a str body is sent as raw bytes."""
    cmp = {"prompt": [ids], "max_tokens": 4}
    return [
        ("/v1/completions", '{"prompt": "hi", "max_tokens": ', 400),  # malformed JSON
        ("/v1/completions", {**cmp, "max_tokens": 0}, 400),
        ("/v1/completions", {**cmp, "max_tokens": -3}, 400),
        ("/v1/completions", {**cmp, "prompt": [[5] * 5000]}, 400),  # context is 4096
        ("/v1/completions", {**cmp, "model": "no-such-model"}, 404),
        ("/v1/chat/completions", {"messages": "hi", "max_tokens": 4}, 400),
        ("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}}, 400),
        ("/generate", {"input_ids": [10**9], "sampling_params": {"max_new_tokens": 2}}, 400),
    ]


def check_error(r: httpx.Response, status: int) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"], err
    assert "type" in err, err


@pytest.mark.parametrize("target", ["router", "prefill", "decode"])
def test_bad_input_gets_4xx_and_servers_stay_healthy(stack, target):
    url = {"router": stack.url, "prefill": stack.prefill, "decode": stack.decode}[target]
    ids = prompt(stack.tok, 0)
    for path, body, status in bad_requests(ids):
        if isinstance(body, str):
            r = httpx.post(url + path, content=body, timeout=30,
                           headers={"content-type": "application/json"})  # fmt: skip
        else:
            r = httpx.post(url + path, json=body, timeout=30)
        check_error(r, status)
    for u in (stack.prefill, stack.decode, stack.url):
        assert httpx.get(u + "/health", timeout=10).status_code == 200
    assert generate(stack.url, ids)["output_ids"] == stack.ref(ids)


def test_api_key_at_the_router(stack):
    """A second router (cheap: no engine) with a key, in front of the same workers."""
    port = free_port()
    boot = httpx.get(stack.url + "/server_info", timeout=5).json()["router"]["prefill"][0][1]
    argv = [sys.executable, "-m", "pdserve.cli", "router", "--port", str(port), "--api-key", "k1",
            "--prefill", stack.prefill, str(boot), "--decode", stack.decode]  # fmt: skip
    proc = spawn(argv, "keyed-router")
    try:
        keyed = dataclasses.replace(stack, url=f"http://127.0.0.1:{port}")
        wait_healthy(keyed.url, [proc], timeout_s=60)
        with pytest.raises(openai.AuthenticationError):
            keyed.client("wrong").completions.create(model=stack.name, prompt="hi", max_tokens=2)
        r = httpx.post(keyed.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       timeout=30)  # fmt: skip
        check_error(r, 401)
        ids = prompt(stack.tok, 1)
        ok = keyed.client("k1").completions.create(model=stack.name, prompt=[ids], max_tokens=NEW,
                                                   temperature=0)  # fmt: skip
        assert ok.choices[0].text == stack.text(stack.ref(ids))
    finally:
        stop(proc, grace_s=5)


# ---- a client gone mid-stream frees every row and page on both sides ---------------------
def server_info(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=10).json()


def all_free(info: dict) -> bool:
    """No row or page held (the draft model's pools too, on a decode that drafts)."""
    return (
        info["free_rows"] == info["total_rows"]
        and info["free_kv_pages"] == info["total_kv_pages"]
        and info["running"] == 0
        and info.get("spec_draft_free_rows") == info.get("spec_draft_total_rows")
        and info.get("spec_draft_free_kv_pages") == info.get("spec_draft_total_kv_pages")
    )


def assert_all_free_soon(stack: Stack, within_s: float = 10.0) -> None:
    """Every row and page of both workers is free within `within_s`."""
    deadline = time.monotonic() + within_s
    infos = [server_info(stack.prefill), server_info(stack.decode)]
    while not all(all_free(i) for i in infos) and time.monotonic() < deadline:
        time.sleep(0.2)
        infos = [server_info(stack.prefill), server_info(stack.decode)]
    assert all(all_free(i) for i in infos), infos


def test_client_disconnect_frees_resources(stack):
    ids = prompt(stack.tok, 2)
    body = {"prompt": [ids], "max_tokens": 3000, "temperature": 0, "stream": True}
    with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks = (ln for ln in r.iter_lines() if ln.startswith("data: "))
        next(chunks), next(chunks)
        busy = server_info(stack.decode)
        assert not all_free(busy), busy  # the request holds a row and pages now
        chunks.close()  # NOTE: closing the line iterator closes the connection
    assert_all_free_soon(stack)
    assert generate(stack.url, ids)["output_ids"] == stack.ref(ids)


def test_arrive_is_the_frontends_handoff_when_stamped():
    """An engine reads new requests between steps: the breakdown's first stage starts at
    the frontend's handoff (EngineRequest.received_at), not at the engine's read."""
    import time

    from pdserve.protocol import EngineRequest
    from pdserve.sampling_params import SamplingParams
    from pdserve.scheduler.request import Req

    sent = time.time() - 0.25  # a step's worth in the inbox
    er = EngineRequest(rid="a", input_ids=[1, 2], params=SamplingParams(), received_at=sent)
    assert Req.from_engine_request(er).stages["arrive"] == sent
    unstamped = Req.from_engine_request(EngineRequest(rid="b", input_ids=[1], params=er.params))
    assert unstamped.stages["arrive"] >= sent + 0.25


def test_ttft_breakdown_spans():
    """The stage arithmetic, with and without the prefill's stamps (no servers needed)."""
    from pdserve.edge.stamps import ttft_breakdown

    st = {"arrive": 1.0, "reserved": 1.5, "kv_done": 2.25, "running": 2.5}
    want = {"queue": 0.5, "kv_transfer": 0.75, "decode_admission": 0.25}
    assert ttft_breakdown(st) == pytest.approx(want)
    full = ttft_breakdown({**st, "prefill_start": 1.625, "prefill_end": 2.0})
    assert full == pytest.approx({**want, "prefill": 0.375, "kv_transfer": 0.25})
    both = ttft_breakdown({**st, "prefill_arrive": 1.25, "prefill_start": 1.625, "prefill_end": 2})
    assert both == pytest.approx(
        {**want, "prefill_queue": 0.375, "prefill": 0.375, "kv_transfer": 0.25}
    )
    assert ttft_breakdown({"arrive": 1.0}) == {}


def test_ttft_breakdown_router_and_frontend_follow_the_prefill_leg():
    """The router's stamp to the prefill frontend's, then to the prefill's handoff; the
    decode leg's own stamps only when the prefill's are missing (no PD)."""
    from pdserve.edge.stamps import ttft_breakdown

    decode = {"router_at": 1.0, "http_at": 1.5, "arrive": 1.75, "reserved": 2.0}
    prefill = {"prefill_http": 1.25, "prefill_arrive": 1.375, "prefill_start": 2.0}
    both = ttft_breakdown({**decode, **prefill, "prefill_end": 2.5})
    assert both["router"] == pytest.approx(0.25) and both["frontend"] == pytest.approx(0.125)
    alone = ttft_breakdown(decode)
    assert alone["router"] == pytest.approx(0.5) and alone["frontend"] == pytest.approx(0.25)
    assert "router" not in ttft_breakdown({"http_at": 1.5, "arrive": 1.75})  # another router


def test_edge_stamps_reach_the_engine_and_bad_ones_are_dropped():
    """The frontend's http_at and the router's header value become the request's stages;
    a header that is not a finite positive number is dropped, never an error."""
    from pdserve.edge.stamps import ROUTER_AT, arrival_stamps, router_header
    from pdserve.protocol import EngineRequest
    from pdserve.sampling_params import SamplingParams
    from pdserve.scheduler.request import Req
    from pdserve.transfer.base import prefill_stages

    assert arrival_stamps(router_header(12.5), now=13.0) == {"http_at": 13.0, "router_at": 12.5}
    for bad in ("", "soon", "nan", "inf", "-1", "0"):
        assert arrival_stamps({ROUTER_AT: bad}, now=13.0) == {"http_at": 13.0}, bad
    assert arrival_stamps({}, now=13.0) == {"http_at": 13.0}
    stamps = {**arrival_stamps(router_header(12.5), now=13.0), "other": 1.0}
    er = EngineRequest(rid="a", input_ids=[1], params=SamplingParams(), stamps=stamps)
    stages = Req.from_engine_request(er).stages
    assert stages["router_at"] == 12.5 and stages["http_at"] == 13.0 and "other" not in stages
    assert prefill_stages({"prefill_http": 13.0, "http_at": 1.0}) == {"prefill_http": 13.0}


# ---- the web console in headless Chromium, on this stack (tests/console_browser.py) -------
def test_console_chat_streams_the_greedy_answer(console_driver, console_shots, stack):
    console_browser.check_chat(console_driver, stack.url, console_shots)


def test_console_stop_ends_the_stream_and_frees_it(console_driver, stack):
    console_browser.check_stop(console_driver, stack.url)
    assert_all_free_soon(stack)


def test_console_live_view_moves_under_load(console_driver, console_shots, stack):
    console_browser.check_live(console_driver, stack.url, console_shots)
