"""Metadata-only (or tiny) GGUF files holding a SentencePiece vocabulary, laid out as
llama.cpp's converter writes Llama 2 and Gemma vocabularies, for tokenizer tests."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from gguf_files import gguf_name

from pdserve.checkpoints import presets as make

SP_CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n\tprint(i * 2)", "Numbers: 3.14159, 2718, 1,000,000 and 42%.",
    "Café, naïve, résumé, Ærøskøbing, straße.", "日本語のテキスト", "emoji 😀 ok 🎉",
    "  two spaces,   three spaces,    four.", "line one\n\nline two\n\n\nline three",
] * 30  # fmt: skip


def _trained_pieces(gemma: bool) -> tuple[list[str], list[tuple[str, str]]]:
    """Pieces (with ▁ for spaces) and merges learned from SP_CORPUS by a BPE trainer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    scheme = "never" if gemma else "first"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme)
    tok.train_from_iterator(SP_CORPUS, trainers.BpeTrainer(vocab_size=700, show_progress=False))
    model = json.loads(tok.to_str())["model"]
    pieces = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return pieces, merges  # type: ignore[return-value]


def write_sentencepiece_gguf(
    path: Path,
    arch: str = "llama",
    merges: bool = False,
    weights: bool = False,
    add_bos: bool | None = True,  # None: the key absent
    space_prefix: bool | None = None,
) -> Path:
    """A metadata-only GGUF holding a small SentencePiece vocabulary laid out as llama.cpp
    writes one: Llama 2 style (<unk> <s> </s>, 256 byte pieces, scores, optional merges)
    or, for a Gemma architecture, Gemma style (<pad> <eos> <bos> <unk>, control and
    user-defined pieces, pieces of spaces stored as spaces, no merges)."""
    gemma = arch.startswith("gemma")
    pieces, learned = _trained_pieces(gemma)
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    if gemma:
        head = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 3), ("<mask>", 3),
                ("[multimodal]", 4), ("<start_of_turn>", 3), ("<end_of_turn>", 3),
                ("\n", 4), ("\n\n", 4), ("\t", 4), ("<unused0>", 3)]  # fmt: skip
        body = [(p.replace("\u2581", " ") if not p.strip("\u2581") else p, 1) for p in pieces]
        body += [("  ", 1), ("   ", 1), ("\u2581\u2581\u2581\u2581", 1)]
    else:
        head = [("<unk>", 2), ("<s>", 3), ("</s>", 3)]
        body = [(p, 1) for p in pieces] + [("<|user|>", 4), ("<|end|>", 3)]
    entries = head + [(b, 6) for b in byte_pieces] + [e for e in body if e[0] not in byte_pieces]
    seen: set[str] = set()
    entries = [e for e in entries if not (e[0] in seen or seen.add(e[0]))]  # type: ignore[func-returns-value]
    tokens = [t for t, _ in entries]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0 if k != 1 else -float(i) for i, (_, k) in enumerate(entries)])
    w.add_token_types([k for _, k in entries])
    if merges and not gemma:
        w.add_token_merges([f"{a} {b}" for a, b in learned if a in seen and b in seen])
    ids = {t: i for i, t in enumerate(tokens)}
    w.add_bos_token_id(ids["<bos>" if gemma else "<s>"])
    w.add_eos_token_id(ids["<eos>" if gemma else "</s>"])
    w.add_unk_token_id(ids["<unk>"])
    if gemma:
        w.add_pad_token_id(ids["<pad>"])
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if space_prefix is not None:  # llama.cpp reads it; transformers does not
        w.add_add_space_prefix(space_prefix)
    if weights:  # a one-layer random Llama over this vocabulary, so the file converts
        p = make.ModelPreset("LlamaForCausalLM", num_layers=1, hidden_size=64, num_heads=2,
                             num_kv_heads=1, intermediate_size=128, vocab_size=len(tokens))  # fmt: skip
        for hf, t in make.init_weights(p, seed=0).items():
            w.add_tensor(gguf_name(hf), t.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
