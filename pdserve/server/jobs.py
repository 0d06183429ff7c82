"""What a frontend's routes and its generation path hand each other: the parsed request
(`Job`, with its PD `Bootstrap` fields), each sample's output as it arrives (`Delta`) and
as a whole (`SampleResult`), and the client error they raise (`RequestError`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.netaddr import bootstrap_problem
from pdserve.protocol import PromptLogprobs, TopLogprobs
from pdserve.sampling_params import SamplingParams

ROOM_MASK = (1 << 63) - 1


class RequestError(Exception):
    """A client error: becomes an HTTP 4xx with an OpenAI-style body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


@dataclass(frozen=True)
class Bootstrap:
    """The PD fields as the router sends them (each may be one value or one per sample)."""

    host: str | list[str] | None = None
    port: int | list[int] | None = None
    room: int | list[int] | None = None

    def for_sample(self, i: int, n: int) -> tuple[int, str | None, int | None]:
        """(room, host, port) of sample `i` of `n`. A single room with n > 1 gives
        rooms room, room+1, ...: both legs derive the same, and samples never share one."""
        room = self.room
        if isinstance(room, list):
            if len(room) != n:
                raise RequestError(f"bootstrap_room has {len(room)} values for n={n}", "n")
            r = room[i]
        else:
            r = 0 if room is None else (room + i) & ROOM_MASK
        return r, *_checked(_pick(self.host, i), _pick(self.port, i))


def _pick(v, i: int):  # type: ignore[no-untyped-def]
    return v[i] if isinstance(v, list) else v


def _checked(host: str | None, port: int | None) -> tuple[str | None, int | None]:
    """A 400 naming the field for an address the decode must never connect to."""
    bad = bootstrap_problem(host, port)
    if bad is not None:
        raise RequestError(bad[1], bad[0])
    return host, port


@dataclass
class Job:
    """One parsed request, ready for the engine: what to run, and for whom."""

    prompts: list[list[int]]  # token ids of each prompt (several: a batch)
    params: SamplingParams
    n: int = 1  # samples per prompt
    rid: str | None = None
    boot: Bootstrap = field(default_factory=lambda: Bootstrap())
    stamps: dict[str, float] = field(default_factory=dict)  # edge/stamps.py arrival_stamps
    # a migrated request (the router's `resume_ids`): the output tokens its client already
    # has; the engine continues after them, the answer counts them and does not resend them
    resume: list[int] = field(default_factory=list)

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n

    def prompt_of(self, index: int) -> list[int]:
        return self.prompts[index // self.n]


OVERLOADED_RETRY_AFTER_S = 1  # the Retry-After of a 503 for a full engine queue


@dataclass
class Delta:
    """New output of one sample since its previous Delta."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # when asked, one a token
    prompt_logprobs: PromptLogprobs | None = None  # when asked, with the first token
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched: int | str | None = None
    error: str | None = None
    stages: dict[str, float] = field(default_factory=dict)
    replayed: bool = False  # the resumed tokens (Job.resume): formatters count, never send


@dataclass
class SampleResult:
    index: int
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None
    matched: int | str | None = None
    error: str | None = None
    stages: dict[str, float] = field(default_factory=dict)

    def add(self, d: Delta) -> None:
        self.text += d.text
        self.output_ids += d.token_ids
        self.logprobs += d.logprobs
        self.top_logprobs += d.top_logprobs
        self.prompt_logprobs = self.prompt_logprobs or d.prompt_logprobs
        if d.finished:
            self.finish_reason, self.matched, self.error = d.finish_reason, d.matched, d.error
            self.stages = d.stages
