"""GGUF files: the per-architecture table of the format (`arch.py`), tensor names and
shapes, metadata to `config.json`, the vocabulary (BPE and SentencePiece), and the
one-time conversion into a Hugging Face folder (`convert.py`)."""
