"""transformers' greedy answers on the Qwen2.5-Coder-0.5B-Instruct GGUF (the file itself,
`from_pretrained(dir, gguf_file=...)`, float32: its Q5_0, Q8_0, Q4_K and Q6_K blocks
de-quantized), computed once and cached.

Loading the file into transformers takes a minute or two on two cores and about 3 GB, so
the answers (prompt ids, greedy ids, their text) are stored as JSON under the pdserve cache
directory, keyed by the file's sha256, the transformers version and the prompts; made once
under a lock (make.build_once), the model loaded once with tests/qwen_tools_reference.py's
(tests/qwen_reference.py). The model is loaded again only to show the logit gap where
pdserve's tokens part from these.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path
from typing import Any

import qwen_reference as loaded
import torch

from pdserve.checkpoints import presets as make
from pdserve.envs import cache_root

SPEC, installed, gguf_file = loaded.SPEC, loaded.installed, loaded.gguf_file
MAX_TOKENS = 16
PROMPTS = {
    "code": "def fibonacci(n):\n",
    "prose": "The capital of France is",
    "numbers": "1, 1, 2, 3, 5, 8, 13,",
}


def _answers() -> dict[str, dict[str, Any]]:
    tok = loaded.tokenizer()
    out = {}
    for name, text in PROMPTS.items():
        ids = list(tok(text)["input_ids"])
        greedy = loaded.greedy(ids, MAX_TOKENS)
        out[name] = {"prompt_ids": ids, "greedy": greedy, "text": tok.decode(greedy)}
    return out


@cache
def answers() -> dict[str, dict[str, Any]]:
    """Per prompt name: transformers' prompt ids, greedy ids and their text."""
    import transformers

    key = hashlib.sha256(json.dumps([PROMPTS, MAX_TOKENS]).encode()).hexdigest()[:12]
    name = f"qwen2.5-coder-0.5b-{SPEC.sha256[:12]}-tf{transformers.__version__}-{key}"

    def build(tmp: Path) -> None:
        (tmp / "answers.json").write_text(json.dumps(_answers()))

    folder = make.build_once(cache_root() / "reference" / name, build)
    return json.loads((folder / "answers.json").read_text())


def logit_gap(context: list[int], a: int, b: int) -> float:
    """|logit(a) - logit(b)| after `context` (loads the model: a minute or two; dropped after)."""
    try:
        with torch.no_grad():
            logits = loaded.model()(torch.tensor([context])).logits[0, -1]
    finally:
        loaded.release()
    return float((logits[a] - logits[b]).abs())
