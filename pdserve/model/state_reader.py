"""Take tensors out of a checkpoint by name, then refuse what was never taken.

A checkpoint is a contract with its config: a tensor the config implies but the
checkpoint lacks, or a tensor the model never reads (a bias the config did not
announce, a layer beyond num_hidden_layers), means the model would compute
something other than what the checkpoint's author trained. Both are errors that
name the tensors.
"""

from __future__ import annotations

import torch

# Buffers some old checkpoints carry; transformers recomputes them and so does pdserve.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointMismatch(ValueError):
    """The checkpoint's tensors do not match what its config describes."""


class StateReader:
    def __init__(
        self, state: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]] | None = None
    ) -> None:
        """`shapes`: the shape the config implies for each tensor name (checked on take)."""
        self._state = state
        self._shapes = shapes or {}
        self._used: set[str] = set()

    def take(self, name: str, why: str = "") -> torch.Tensor:
        if name not in self._state:
            reason = f" ({why})" if why else ""
            raise CheckpointMismatch(f"checkpoint is missing tensor {name!r}{reason}")
        t = self._state[name]
        want = self._shapes.get(name)
        if want is not None and tuple(t.shape) != want:
            raise CheckpointMismatch(
                f"tensor {name!r} has shape {tuple(t.shape)}; the config implies {want}"
            )
        self._used.add(name)
        return t

    def take_optional(self, name: str) -> torch.Tensor | None:
        return self.take(name) if name in self._state else None

    def check_all_used(self) -> None:
        unused = sorted(
            n for n in self._state if n not in self._used and not n.endswith(_IGNORED_SUFFIXES)
        )
        if unused:
            shown = ", ".join(unused[:8]) + (
                f" and {len(unused) - 8} more" if len(unused) > 8 else ""
            )
            raise CheckpointMismatch(
                f"checkpoint has {len(unused)} tensor(s) the config does not use: {shown}"
            )
