"""Penalties and logit bias, as vLLM defines them, with the per-request state they need.

For request i with output-token counts c (tokens it generated so far) and prompt set P:

    logits[t] += logit_bias[t]                                   (each biased token t)
    t in P or c[t] > 0:  logits[t] = logits[t] / r  if logits[t] > 0 else logits[t] * r
    logits[t] -= frequency_penalty * c[t] + presence_penalty * (c[t] > 0)

(r: repetition_penalty). The state lives on the device with the request (`Req`), so a
decode step updates it on the forward stream right after sampling, without the
sampled token coming to the host; a step built before the previous step's token is
known still sees it, since both run in order on the forward stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.sampling_params import SamplingParams


@dataclass(eq=False)
class PenaltyState:
    """One request's history as the penalties read it (device tensors, [V] each)."""

    prompt_mask: torch.Tensor  # bool: token appears in the prompt
    counts: torch.Tensor  # float32: times the token was generated

    @classmethod
    def new(
        cls, params: SamplingParams, prompt: list[int], vocab: int, device: str | torch.device
    ) -> PenaltyState | None:
        """The state of a request that needs one (penalties set), else None."""
        if not params.penalized:
            return None
        mask = torch.zeros(vocab, dtype=torch.bool, device=device)
        mask[torch.tensor(prompt, dtype=torch.int64, device=device)] = True
        return cls(mask, torch.zeros(vocab, dtype=torch.float32, device=device))

    def record(self, token: torch.Tensor) -> None:
        """Count a sampled token (a 0-d or 1-element device tensor; no host sync)."""
        self.counts.index_add_(0, token.reshape(1), torch.ones(1, device=self.counts.device))


def bias_tensor(p: SamplingParams, vocab: int, device: torch.device) -> torch.Tensor | None:
    if not p.logit_bias:
        return None
    ids = torch.tensor(list(p.logit_bias), dtype=torch.int64)
    values = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32)
    return torch.zeros(vocab).index_put_((ids,), values).to(device)


def adjust(logits: torch.Tensor, p: SamplingParams, state: PenaltyState | None) -> torch.Tensor:
    """One request's logits [V] with its bias and penalties applied (a new tensor)."""
    out = logits.float()
    bias = bias_tensor(p, out.shape[-1], out.device)
    if bias is not None:
        out = out + bias
    if state is None:
        return out
    seen = state.counts > 0
    if p.repetition_penalty != 1.0:
        hit = seen | state.prompt_mask
        scaled = torch.where(out > 0, out / p.repetition_penalty, out * p.repetition_penalty)
        out = torch.where(hit, scaled, out)
    if p.frequency_penalty != 0.0:
        out = out - p.frequency_penalty * state.counts
    if p.presence_penalty != 0.0:
        out = out - p.presence_penalty * seen.float()
    return out
