"""What transformers' tokenizer built from a SentencePiece GGUF says about a list of texts
(ids with and without special tokens, decodes, the named tokens, its tokenizer.json), the
reference tests/test_gguf_sentencepiece.py compares pdserve's tokenizer with.

For Gemma 3's own file transformers takes about half a minute to build its tokenizer
(reading and converting 262,144 pieces), so those facts are stored as JSON under the
pdserve cache directory, keyed by the file's sha256, the transformers and tokenizers
versions and the texts; made once under a lock (checkpoints/build_once.py), as
tests/gemma3_reference.py does for that model's greedy answers.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pdserve.checkpoints.build_once import build_once
from pdserve.envs import cache_root

NAMED = ("bos_token", "eos_token", "unk_token", "pad_token")


def facts(theirs: Any, texts: list[str]) -> dict[str, Any]:
    """The reference answers of a loaded transformers tokenizer (JSON-safe: bool keys as
    "True"/"False")."""
    ids = {t: {str(s): theirs(t, add_special_tokens=s)["input_ids"] for s in (True, False)}
           for t in texts}  # fmt: skip
    decoded = {t: {str(k): theirs.decode(ids[t]["False"], skip_special_tokens=k)
                   for k in (True, False)} for t in texts}  # fmt: skip
    return {
        "ids": ids,
        "decoded": decoded,
        "add_bos_token": theirs.add_bos_token,
        "named": {name: getattr(theirs, name) for name in NAMED},
        "backend": json.loads(theirs.backend_tokenizer.to_str()),
    }


def load(path: Path) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def cached_facts(path: Path, sha256: str, texts: list[str]) -> dict[str, Any]:
    """`facts` of transformers' tokenizer for the GGUF at `path` (whose sha256 is given),
    made once and then read from the cache."""
    import tokenizers
    import transformers

    key = hashlib.sha256(json.dumps(texts).encode()).hexdigest()[:12]
    name = (f"sp-tokenizer-{sha256[:12]}-tf{transformers.__version__}"
            f"-tok{tokenizers.__version__}-{key}")  # fmt: skip

    def build(tmp: Path) -> None:
        (tmp / "facts.json").write_text(json.dumps(facts(load(path), texts)))

    folder = build_once(cache_root() / "reference" / name, build)
    return json.loads((folder / "facts.json").read_text())
