"""A byte-level BPE tokenizer for the reference checkpoints, trained at make time.

The merges are learned from the Python standard library's own `.py` sources
(always present, so nothing is downloaded), read in sorted path order and capped
by size, which makes training deterministic for a given Python install.

Id layout (vocab_size = V):

    0 .. len(SPECIAL_TOKENS)-1   special tokens, in SPECIAL_TOKENS order
    ..                           256 byte symbols, then learned merges
    .. V-1                       `<|reserved_N|>` fillers, only if the corpus ran out
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"  # also the pad token
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
BOS_TOKEN = "<|bos|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END, BOS_TOKEN)

# Corpus size: BYTES_PER_TOKEN * vocab_size, clamped; 8 MB holds enough distinct words
# for 32000 merges (training takes seconds), 1 MB is plenty for 4096.
BYTES_PER_TOKEN = 256
CORPUS_BYTES = (1_000_000, 8_000_000)

# ChatML. Renders `<|im_start|>{role}\n{content}<|im_end|>\n` per message.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

# vocab_size -> serialized tokenizer.json; training is deterministic, so one per process
_TRAINED: dict[int, str] = {}


def special_token_id(token: str) -> int:
    """Id of a special token; the same for every vocab size."""
    return SPECIAL_TOKENS.index(token)


def _corpus(limit: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    texts: list[str] = []
    total = 0
    for path in files:
        if total >= limit:
            break
        data = path.read_bytes()[: limit - total]
        texts.append(data.decode("utf-8", errors="replace"))
        total += len(data)
    return texts


def _train(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # No normalizer: any UTF-8 string must survive encode -> decode unchanged.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lo, hi = CORPUS_BYTES
    tok.train_from_iterator(_corpus(min(hi, max(lo, BYTES_PER_TOKEN * vocab_size))), trainer)
    short = vocab_size - tok.get_vocab_size()
    if short > 0:  # corpus too small for the requested merges: fill with reserved ids
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(short)])
    return tok


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer with exactly `vocab_size` ids (specials included).

    Precondition: vocab_size >= len(SPECIAL_TOKENS) + 256. Cached per vocab size.
    """
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the byte alphabet")
    if vocab_size not in _TRAINED:
        tok = _train(vocab_size)
        assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
        _TRAINED[vocab_size] = tok.to_str()
    return Tokenizer.from_str(_TRAINED[vocab_size])


def tokenizer_config(model_max_length: int) -> dict[str, object]:
    """The `tokenizer_config.json` that lets `transformers` load tokenizer.json as is."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
