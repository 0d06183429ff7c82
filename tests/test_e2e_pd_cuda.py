"""`pdserve up --device cuda` end to end: router -> prefill (GPU) -> ZeroMQ KV from
pinned staging -> decode (GPU, CUDA streams). Greedy tokens equal transformers' on the
CPU, one at a time and eight at once, streamed and not; afterwards every row and page
is free on both sides. Skipped without a GPU."""

from __future__ import annotations

import sys

import httpx
import pytest
import torch
from conftest import hf_greedy, model_path
from tokenizers import Tokenizer

from tests.test_e2e_pd import (
    N_PROMPTS,
    NEW,
    Stack,
    assert_all_free_soon,
    check_concurrent,
    free_port,
    generate,
    pool_args,
    prompt,
    spawn,
    sse_objects,
    stop,
    wait_healthy,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: the engines run on the GPU"
)


@pytest.fixture(scope="module")
def stack():
    model = model_path("tiny")
    port = free_port()
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port), "--grace-period",
            "5", "--model", str(model), "--device", "cuda", *pool_args()]  # fmt: skip
    proc = spawn(argv, "up-cuda")
    url = f"http://127.0.0.1:{port}"
    try:
        tok = Tokenizer.from_file(str(model / "tokenizer.json"))
        prompts = [prompt(tok, i) for i in range(N_PROMPTS)]
        refs = {tuple(p): hf_greedy(model, p, NEW) for p in prompts}  # while the servers start
        wait_healthy(url, [proc])
        info = httpx.get(url + "/server_info", timeout=5).json()["router"]
        yield Stack(url, info["prefill"][0][0], info["decode"][0], model, tok, refs)
    finally:
        stop(proc)


def test_generate_and_stream_match_transformers(stack):
    for i in range(N_PROMPTS):
        ids = prompt(stack.tok, i)
        assert generate(stack.url, ids)["output_ids"] == stack.ref(ids)
    ids = prompt(stack.tok, 1)
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": NEW, "temperature": 0}}  # fmt: skip
    with httpx.stream("POST", stack.url + "/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert sse_objects(r)[-1]["output_ids"] == stack.ref(ids)


def test_concurrent_requests_match_transformers_and_free_everything(stack):
    check_concurrent(stack, 16)
    assert_all_free_soon(stack)
