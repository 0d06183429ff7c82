"""The draft model of `--speculative draft`: its runner (the model, its own request rows
and KV pool) and the check that it speaks the served model's vocabulary.

A draft token is an id the target verifies as is, so the two must number their tokens
alike: the same vocabulary size, the same end-of-sequence ids and the same special
tokens. Anything else is refused at start-up, naming what differs.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from pdserve.config import EngineConfig, SpeculativeConfig
from pdserve.model.arch.config import ModelArch
from pdserve.model.arch.registry import load_arch
from pdserve.model.runner import ModelRunner


def load_draft(cfg: EngineConfig, target: ModelRunner) -> ModelRunner:
    """The draft model's runner beside `target` (the decode's), on its cores; the weights
    are `target`'s own when both name the same model (a model drafting for itself)."""
    spec = cfg.speculative
    problem = vocab_problem(target, load_arch(spec.draft_model), spec.draft_model)
    if problem:
        raise ValueError(problem)
    same = Path(spec.draft_model).resolve() == Path(cfg.model_path).resolve()
    runner = ModelRunner(draft_config(cfg, target.max_context), model=target.model if same else None,
                         cores=target.cores)  # fmt: skip
    runner.warm_up_decode()  # its one-token drafting steps take the native decode path
    return runner


def draft_config(cfg: EngineConfig, max_context: int) -> EngineConfig:
    """The draft runner's config: the decode's, with the draft model, its own pool
    (--draft-max-tokens, else as many tokens as the decode's) spanning the decode's
    context, and no speculation of its own."""
    spec = cfg.speculative
    tokens = spec.draft_max_tokens or cfg.cache.max_total_tokens
    cache = replace(cfg.cache, max_total_tokens=tokens, max_context=max_context,
                    prefix_cache=False)  # fmt: skip
    return replace(cfg, model_path=spec.draft_model, cache=cache, speculative=SpeculativeConfig())


def vocab_problem(target: ModelRunner, draft: ModelArch, draft_path: str) -> str:
    """Why `draft` cannot draft for `target` ("" when it can)."""
    t = target.arch
    what = f"--draft-model {draft_path}"
    if draft.vocab_size != t.vocab_size:
        return (f"{what}: its vocabulary has {draft.vocab_size} ids, the served model's "
                f"{t.vocab_size}; a draft model must share the served model's tokenizer")  # fmt: skip
    if set(draft.eos_token_ids) != set(t.eos_token_ids):
        return (f"{what}: its end-of-sequence ids {sorted(draft.eos_token_ids)} differ from "
                f"the served model's {sorted(t.eos_token_ids)}")  # fmt: skip
    mine, theirs = special_tokens(Path(draft_path)), special_tokens(Path(target.cfg.model_path))
    if mine is not None and theirs is not None and mine != theirs:
        diff = sorted(set(mine.items()) ^ set(theirs.items()))[:4]
        return (f"{what}: its special tokens differ from the served model's "
                f"(id, text: {diff})")  # fmt: skip
    return ""


def special_tokens(model_dir: Path) -> dict[int, str] | None:
    """The special tokens of a folder's tokenizer.json (id -> text); None without one."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    added = json.loads(path.read_text(encoding="utf-8")).get("added_tokens") or []
    return {int(a["id"]): str(a["content"]) for a in added if a.get("special", True)}
