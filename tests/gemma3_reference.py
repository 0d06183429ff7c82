"""transformers' greedy answers on the Gemma 3 270M GGUF (the file itself, loaded with
`from_pretrained(dir, gguf_file=...)`, float32), computed once and cached.

Loading the file into transformers takes about a minute on two cores, so the answers
(prompt ids, greedy ids, their text) are stored as JSON under the pdserve cache
directory, keyed by the file's sha256, the transformers version and the prompts; made
once under a lock (checkpoints/build_once.py). The model itself is loaded again only to show the
logit gap where pdserve's tokens part from these.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path
from typing import Any

import torch

from pdserve.checkpoints import wheels as model_wheels
from pdserve.checkpoints.build_once import build_once
from pdserve.envs import cache_root

MAX_TOKENS = 24
# the Gemma 3 window is 512 keys: the long prompt runs past it, so its sliding layers
# see only the last 512 positions (in prefill chunks and in decode)
_DAYS = "".join(
    f"Day {i}: Alice walked {i % 7 + 2} miles to the {('market', 'river', 'library')[i % 3]}"
    f" and bought {i % 5 + 1} apples.\n"
    for i in range(1, 41)
)
PROMPTS = {
    "prose": "The capital of France is",
    "code": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "numbers": "1, 1, 2, 3, 5, 8, 13, 21, 34,",
    "long": _DAYS + "Day 41: Alice walked",
}


def gguf_file() -> Path:
    return model_wheels.assembled_gguf(model_wheels.GEMMA3_270M)


def _load(path: Path) -> tuple[Any, Any]:
    import transformers

    kw = {"gguf_file": path.name}
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), dtype=torch.float32, **kw
    )
    return tok, model.eval()


def _answers(path: Path) -> dict[str, dict[str, Any]]:
    tok, model = _load(path)
    out = {}
    for name, text in PROMPTS.items():
        ids = list(tok(text)["input_ids"])
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
            )
        greedy = gen[0, len(ids) :].tolist()
        text_out = tok.decode(greedy, skip_special_tokens=True)
        out[name] = {"prompt_ids": ids, "greedy": greedy, "text": text_out}
    return out


@cache
def answers() -> dict[str, dict[str, Any]]:
    """Per prompt name: transformers' prompt ids, greedy ids (EOS included) and text."""
    import transformers

    spec = model_wheels.GEMMA3_270M
    key = hashlib.sha256(json.dumps([PROMPTS, MAX_TOKENS]).encode()).hexdigest()[:12]
    name = f"gemma3-270m-{spec.sha256[:12]}-tf{transformers.__version__}-{key}"
    path = gguf_file()

    def build(tmp: Path) -> None:
        (tmp / "answers.json").write_text(json.dumps(_answers(path)))

    folder = build_once(cache_root() / "reference" / name, build)
    return json.loads((folder / "answers.json").read_text())


def logit_gap(context: list[int], a: int, b: int) -> float:
    """|logit(a) - logit(b)| after `context` (loads the model: about a minute)."""
    _, model = _load(gguf_file())
    with torch.no_grad():
        logits = model(torch.tensor([context])).logits[0, -1]
    return float((logits[a] - logits[b]).abs())
