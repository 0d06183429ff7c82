"""Workloads: random prompts, a ShareGPT-format file, shared-prefix groups.

Every dataset is a pure function of the config and its seed. Prompt lengths are
exact token counts when a tokenizer is given (or prompts are token ids), and
word counts (about one token per word) otherwise.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.config import BenchConfig

# Short, common English words: each is one token in the usual BPE vocabularies,
# so a prompt of n words is close to n tokens without a tokenizer.
_WORDS = (
    "the of and to in is that it for on was with as be at by this had not are but from or have "
    "an they which one you were her all she there would their we him been has when who will more "
    "no if out so said what up its about into than them can only other new some could time these "
    "two may then do first any my now such like our over man me even most made after also did "
    "many before must through back years where much your way well down should because each just"
).split()

DEFAULT_VOCAB = 1000


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]  # text, or token ids
    prompt_len: int  # tokens (see module docstring for exactness)
    output_len: int  # max new tokens asked for (ignore_eos makes it exact)


class PromptMaker:
    """Random prompts of a given token length, as text or token ids."""

    def __init__(
        self, rng: random.Random, tokenizer_dir: str | None, as_ids: bool, vocab: int | None
    ):
        self.rng = rng
        self.as_ids = as_ids
        self.tok = _load_tokenizer(tokenizer_dir) if tokenizer_dir else None
        tok_vocab = self.tok.get_vocab_size() if self.tok is not None else DEFAULT_VOCAB
        self.vocab = vocab or tok_vocab

    def random(self, n: int) -> tuple[str | list[int], int]:
        """A prompt of `n` tokens and its length as counted by `count`."""
        if self.as_ids:
            return [self.rng.randrange(self.vocab) for _ in range(n)], n
        if self.tok is None:
            return " ".join(self.rng.choice(_WORDS) for _ in range(n)), n
        text = self._exact_text(n)
        return text, self.count(text)

    def count(self, text: str) -> int:
        if self.tok is None:
            return len(text.split())
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def join(self, a: str | list[int], b: str | list[int]) -> str | list[int]:
        if isinstance(a, list) and isinstance(b, list):
            return a + b
        return f"{a} {b}"

    def _exact_text(self, n: int) -> str:
        # decode(random ids) re-encodes to about n tokens; trim or pad and retry a few
        # times, since merges across the cut can shift the count by one or two.
        assert self.tok is not None
        ids = [self.rng.randrange(self.vocab) for _ in range(n)]
        text = self.tok.decode(ids, skip_special_tokens=True)
        for _ in range(8):
            ids = self.tok.encode(text, add_special_tokens=False).ids
            if len(ids) == n:
                break
            if len(ids) > n:
                ids = ids[:n]
            else:
                ids += [self.rng.randrange(self.vocab) for _ in range(n - len(ids))]
            text = self.tok.decode(ids, skip_special_tokens=True)
        return text


def _load_tokenizer(folder: str):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer

    path = Path(folder)
    path = path / "tokenizer.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"--tokenizer: no tokenizer.json at {path}")
    return Tokenizer.from_file(str(path))


def build_requests(cfg: BenchConfig) -> list[BenchRequest]:
    """`cfg.num_warmup + cfg.num_prompts` requests; the warm-up ones come first."""
    rng = random.Random(cfg.seed)
    maker = PromptMaker(rng, cfg.tokenizer, cfg.random_tokens_as_ids, cfg.vocab_size)
    n = cfg.num_warmup + cfg.num_prompts
    if cfg.dataset == "random":
        return random_requests(cfg, maker, n)
    if cfg.dataset == "sharegpt":
        assert cfg.dataset_path is not None
        return _cycle(sharegpt_requests(cfg.dataset_path, maker), n)
    return _cycle(shared_prefix_requests(cfg, maker, n), n)


def random_requests(cfg: BenchConfig, maker: PromptMaker, n: int) -> list[BenchRequest]:
    out = []
    for _ in range(n):
        in_len = maker.rng.randint(*cfg.random_input_len)
        out_len = maker.rng.randint(*cfg.random_output_len)
        prompt, plen = maker.random(in_len)
        out.append(BenchRequest(prompt, plen, out_len))
    return out


def sharegpt_requests(path: str, maker: PromptMaker) -> list[BenchRequest]:
    """conversations[0] (human) is the prompt; conversations[1] (gpt) sets the output length."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    out = []
    for entry in data:
        conv = entry.get("conversations") or entry.get("conversation") or []
        if len(conv) < 2:
            continue
        prompt, answer = str(conv[0].get("value", "")), str(conv[1].get("value", ""))
        plen, olen = maker.count(prompt), maker.count(answer)
        if plen >= 1 and olen >= 1:
            out.append(BenchRequest(prompt, plen, olen))
    if not out:
        raise ValueError(f"{path}: no usable conversations (need a human turn and a gpt turn)")
    maker.rng.shuffle(out)
    return out


def shared_prefix_requests(cfg: BenchConfig, maker: PromptMaker, n: int) -> list[BenchRequest]:
    """G groups x P prompts: a group's prompts share a prefix of `shared_prefix_len`
    tokens, each followed by its own suffix; the order interleaves groups at random."""
    groups = cfg.shared_prefix_groups
    per_group = cfg.shared_prefix_prompts_per_group or math.ceil(n / groups)
    out = []
    for _ in range(groups):
        prefix, prefix_len = maker.random(cfg.shared_prefix_len)
        for _ in range(per_group):
            suffix, suffix_len = maker.random(cfg.shared_prefix_suffix_len)
            out_len = maker.rng.randint(*cfg.random_output_len)
            out.append(BenchRequest(maker.join(prefix, suffix), prefix_len + suffix_len, out_len))
    maker.rng.shuffle(out)
    return out


def _cycle(items: list[BenchRequest], n: int) -> list[BenchRequest]:
    return [items[i % len(items)] for i in range(n)]
