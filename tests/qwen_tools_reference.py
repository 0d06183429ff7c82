"""transformers' prompts and greedy answers for the Qwen2.5-Coder-0.5B tool round trip
(tests/test_real_qwen_tools.py), on the GGUF itself (float32), computed once and cached
under the pdserve cache directory keyed by the file, the transformers version and the
conversation (loading the model takes about a minute on two cores; it is loaded once with
tests/qwen_greedy_reference.py's: tests/qwen_reference.py)."""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path
from typing import Any

import qwen_reference as loaded

from pdserve.checkpoints import presets as make
from pdserve.envs import cache_root
from pdserve.server.tool_calls import parse_tool_calls

MAX_TOKENS = 32  # both answers end at <|im_end|> before this
RESULT = '{"city": "Paris", "temperature_c": 17.3}'
TOOLS = [
    {"type": "function", "function": {"name": name, "description": text, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    for name, text in [("get_weather", "Current temperature in a city, in Celsius"),
                       ("get_time", "Current local time in a city")]
]  # fmt: skip
NAMES = frozenset({"get_weather", "get_time"})
TURN1 = [
    {"role": "system", "content": "Answer the user's question in plain text using the tool results."},
    {"role": "user", "content": "What's the current temperature in Paris? Reply with one sentence."},
]  # fmt: skip


gguf_file = loaded.gguf_file


def _as_transformers(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as transformers' templates take them: a call's arguments an object."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(
                c["function"]["arguments"])}} for c in m["tool_calls"]]  # fmt: skip
            m.setdefault("content", "")
        out.append(m)
    return out


def prompt_ids(messages: list[dict[str, Any]], tools: list[Any] | None) -> list[int]:
    return list(loaded.tokenizer().apply_chat_template(_as_transformers(messages), tools=tools,
        add_generation_prompt=True, tokenize=True, return_dict=False))  # fmt: skip


def _greedy(ids: list[int]) -> dict[str, Any]:
    greedy = loaded.greedy(ids, MAX_TOKENS)
    return {"prompt_ids": ids, "greedy": greedy,
            "text": loaded.tokenizer().decode(greedy, skip_special_tokens=True)}  # fmt: skip


def _answers() -> dict[str, Any]:
    turn1 = _greedy(prompt_ids(TURN1, TOOLS))
    calls = parse_tool_calls(turn1["text"], NAMES)[1]
    said = {"role": "assistant", "content": None,
            "tool_calls": [{k: c[k] for k in ("id", "type", "function")} for c in calls]}  # fmt: skip
    turn2 = TURN1 + [said, {"role": "tool", "tool_call_id": "x", "content": RESULT}]
    return {"turn1": turn1, "turn2": _greedy(prompt_ids(turn2, None))}


@cache
def answers() -> dict[str, Any]:
    import transformers

    spec = loaded.SPEC
    key = hashlib.sha256(json.dumps([TOOLS, TURN1, RESULT, MAX_TOKENS]).encode()).hexdigest()
    name = f"qwen2.5-coder-0.5b-{spec.sha256[:12]}-tf{transformers.__version__}-{key[:12]}"

    def build(tmp: Path) -> None:
        (tmp / "answers.json").write_text(json.dumps(_answers()))

    folder = make.build_once(cache_root() / "reference" / name, build)
    return json.loads((folder / "answers.json").read_text())
