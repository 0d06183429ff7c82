"""Read safetensors weights (one file or an indexed set of shards) from a HF folder.

Tensors named in `skip` are not read: they come back as `meta` tensors of their stored
shape (shapes checked, no memory), for weights served from elsewhere (model/quant_weights.py).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def iter_weights(
    model_dir: str | Path, skip: Collection[str] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    for name in files:
        with safe_open(str(model_dir / name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if key in skip:
                    yield key, torch.empty(f.get_slice(key).get_shape(), device="meta")
                else:
                    yield key, f.get_tensor(key)


def load_state(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: str,
    skip: Collection[str] = (),
    copy: bool = False,
) -> dict[str, torch.Tensor]:
    """`copy`: each tensor in memory of its own, not a view of the file's mapping (which
    stays mapped, its read pages resident, while any view of it lives)."""
    out = {}
    for k, v in iter_weights(model_dir, skip):
        out[k] = v.to(dtype=dtype) if v.is_meta else v.to(dtype=dtype, device=device, copy=copy)
    return out
