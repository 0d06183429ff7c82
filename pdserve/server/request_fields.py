"""What a request body may hold: every field known, implemented or refused by name.

A body model declares each field a client may send. Those the server implements
are typed and used; those it knows but does not implement are listed in
`NOT_IMPLEMENTED` with the values that mean "off" (a value outside those is a 400
naming the field); anything else is an unknown field, refused the same way unless
the server runs with `--unknown-fields warn` (then logged and dropped).

The sampling knobs shared by the OpenAI routes and `/generate`'s `sampling_params`
live in `SamplingKnobs`, whose `params()` is the one place a SamplingParams is built
from a request.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from pdserve.sampling_params import SamplingParams
from pdserve.server.jobs import RequestError

log = logging.getLogger(__name__)


class FieldRefused(RequestError):
    """A field the server will not honour: a 400 whose `param` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message, param)


class Body(BaseModel):
    """A request body (or a nested object of one) whose every field is accounted for."""

    model_config = ConfigDict(extra="allow")
    # field -> the values that leave it off (None, the field's absence, is always off)
    NOT_IMPLEMENTED: ClassVar[dict[str, tuple[Any, ...]]] = {}

    def check_fields(self, unknown: str = "refuse", where: str = "") -> None:
        """Raise FieldRefused for a known field set to a value not implemented, or for an
        unknown field (with `unknown == "warn"`: log it and carry on); nested bodies too."""
        for name, off in self.NOT_IMPLEMENTED.items():
            value = getattr(self, name)
            if value is not None and not any(_same(value, v) for v in off):
                raise FieldRefused(f"{where}{name} is not supported by this server "
                                   f"(got {short_repr(value)})", where + name)  # fmt: skip
        extra = sorted(self.model_extra or {})
        if extra and unknown == "warn":
            log.warning("ignoring unknown request fields: %s", ", ".join(where + e for e in extra))
        elif extra:
            raise FieldRefused(f"unknown field {where}{extra[0]!r}", where + extra[0])
        for name in type(self).model_fields:
            _check_nested(getattr(self, name), unknown, f"{where}{name}.")


def _check_nested(value: Any, unknown: str, where: str) -> None:
    if isinstance(value, Body):
        value.check_fields(unknown, where)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_nested(v, unknown, f"{where}{i}.")


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class SamplingKnobs(Body):
    """Sampling fields with the same name and meaning in the OpenAI routes (vLLM's and
    sglang's extensions included) and in `/generate`'s `sampling_params`."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    speculative: bool = True  # pdserve's: False opts this request out of speculative decoding
    NOT_IMPLEMENTED: ClassVar[dict[str, tuple[Any, ...]]] = {"min_tokens": (0,)}

    def params(self, max_tokens: int, logprobs: bool, top: int = 0,
               prompt_top: int | None = None) -> SamplingParams:  # fmt: skip
        """The engine's SamplingParams (call check_fields first); `top`: the top k logprobs
        of each output token, `prompt_top`: the prompt's logprobs with their top k."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=as_list(self.stop),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self._logit_bias(),
            top_logprobs=top,
            prompt_logprobs=prompt_top,
            speculative=self.speculative,
        )

    def _logit_bias(self) -> dict[int, float]:
        out = {}
        for k, v in (self.logit_bias or {}).items():
            try:
                out[int(k)] = v
            except ValueError:
                raise FieldRefused(
                    f"logit_bias keys are token ids, got {k!r}", "logit_bias"
                ) from None
        return out


def as_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


N_FIELD = Field(default=1, ge=1, le=64)
