"""SmolLM2 (the default model: a Q4_1 GGUF whose embedding is Q8_0) served through the
whole PD path with --weights quantized: both engines compute every projection and the
embedding from the GGUF's blocks (their logs say so, with the bytes held, about the file's
size), and the greedy chat answers equal transformers' on the same GGUF, which
de-quantizes it (tests/test_real_model.py's reference). The stack and the reference are
the session's shared ones (tests/smollm2_stack.py)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from test_real_model import CONVERSATIONS, EOS, MAX_TOKENS, Reference

from pdserve.checkpoints.resolve import smollm2_gguf

BLOCKS = "in GGUF blocks: Q4_1 x210, Q8_0 x1, Q8_0 (embedding) x1"


@pytest.fixture(scope="module")
def ref(smollm2_ref: Reference) -> Reference:
    return smollm2_ref


@pytest.fixture(scope="module")
def server(smollm2_stack) -> tuple[str, Path]:
    """The session's SmolLM2 stack (tests/smollm2_stack.py), started with --weights quantized."""
    return smollm2_stack.url, smollm2_stack.logs


def test_both_engines_hold_the_gguf_blocks(server):
    _, logs = server
    size_mb = smollm2_gguf().stat().st_size / 1e6
    for role in ("prefill0", "decode0"):
        text = (Path(logs) / f"{role}.log").read_text()
        assert BLOCKS in text, role
        held = re.search(r"weights: ([\d.]+) MB resident", text)
        assert held is not None, role
        assert float(held.group(1)) <= 1.2 * size_mb, (role, held.group(1), size_mb)


def test_pd_greedy_answers_equal_transformers(ref, server):
    url, _ = server
    for messages in CONVERSATIONS[:1]:  # test_real_model.py serves the others (same default)
        body = {"model": "smollm2", "messages": messages, "temperature": 0,
                "max_tokens": MAX_TOKENS, "logprobs": True}  # fmt: skip
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        want = ref.greedy(ref.chat_ids(messages))
        assert choice["message"]["content"] == ref.tok.decode(want, skip_special_tokens=True)
        assert choice["finish_reason"] == "stop" and want[-1] == EOS
        assert r.json()["usage"]["completion_tokens"] == len(want)
