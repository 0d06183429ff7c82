"""What a prefill and a decode must agree on to share KV: the served model's identity.

    fingerprint = "arch=<architecture>;vocab=<vocab_size>;layers=<per layer attention>;
                   config=<hash>;kv=<KV layout>"

`config` hashes every ModelArch field that changes the computation (all of them but
those in NOT_COMPUTATION), so a field added to ModelArch is covered without a change
here. `layers` spells out what differs from layer to layer (window and rope, e.g.
Gemma 3's sliding and full layers) in runs, "5x(w512,r10000)+1x(full,r1e+06)", so a
mismatch there is named, not only a hash. Two engines whose fingerprints differ would hand each other KV (or token ids)
that mean something else; the transfer refuses such a pair by room, naming the part.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from pdserve.kvcache.pools import KVLayout

# Fields that only decide when to stop or how the checkpoint was stored, not what
# a forward pass computes (the serving dtype is part of the KV layout).
NOT_COMPUTATION = frozenset({"eos_token_ids", "torch_dtype"})


def config_hash(arch: Any) -> str:
    """Hash of `arch` (a ModelArch dataclass) minus NOT_COMPUTATION fields."""
    fields = {k: v for k, v in dataclasses.asdict(arch).items() if k not in NOT_COMPUTATION}
    blob = json.dumps(fields, sort_keys=True, default=repr).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def layers_part(arch: Any) -> str:
    """Each layer's attention window and rope theta (a ModelArch), in runs."""
    runs: list[list[Any]] = []
    for window in arch.layer_windows:  # the rule of ModelArch.layer_rope
        sliding = arch.sliding_rope is not None and window
        theta, scaling = arch.sliding_rope if sliding else (arch.rope_theta, arch.rope_scaling)
        kind = scaling.get("rope_type", "") if isinstance(scaling, dict) else ""
        layer = f"{f'w{window}' if window else 'full'},r{theta:g}{kind}"
        if runs and runs[-1][1] == layer:
            runs[-1][0] += 1
        else:
            runs.append([1, layer])
    return "+".join(f"{n}x({layer})" for n, layer in runs)


def model_fingerprint(arch: Any, layout: KVLayout) -> str:
    parts = {
        "arch": arch.architecture,
        "vocab": str(arch.vocab_size),
        "layers": layers_part(arch),
        "config": config_hash(arch),
        "kv": layout.fingerprint(),
    }
    return ";".join(f"{k}={v}" for k, v in parts.items())


def _parts(fingerprint: str) -> dict[str, str]:
    return dict(p.partition("=")[::2] for p in fingerprint.split(";") if p)


def describe_mismatch(decode: str, prefill: str) -> str:
    """The differing parts, e.g. "vocab: decode 512, prefill 1024"."""
    d, p = _parts(decode), _parts(prefill)
    diff = [f"{k}: decode {d.get(k, '?')}, prefill {p.get(k, '?')}"
            for k in dict.fromkeys([*p, *d]) if d.get(k) != p.get(k)]  # fmt: skip
    return "; ".join(diff) or f"decode {decode!r}, prefill {prefill!r}"
