"""The OpenAI routes' request bodies: every field the `openai` client sends, plus vLLM's
and sglang's common extensions, each implemented or refused by name (request_fields.py).

docs/api.md lists them; tests/test_openai_fields.py reads the field list from the
installed `openai` package and checks each one here.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, NamedTuple

from pydantic import Field

from pdserve.sampling_params import MAX_TOP_LOGPROBS
from pdserve.server.jobs import Bootstrap
from pdserve.server.request_fields import (
    N_FIELD,
    Body,
    FieldRefused,
    SamplingKnobs,
)
from pdserve.server.request_fields import (
    short_repr as _short,
)

# Fields that identify the caller or tag the request for the caller's own records; by
# their definition they never change the output, so they are accepted as they are:
# user, safety_identifier, metadata, prompt_cache_key (a cache-routing hint).


class Options(NamedTuple):
    """A body's derived values (_OpenAIBody.options)."""

    boot: Bootstrap
    include_usage: bool
    max_tokens: int | None  # chat: max_completion_tokens, else max_tokens
    tools: bool  # chat: parse tool calls out of the answer (ChatIn.parse_tools)
    top: int = 0  # the top k logprobs of each output token
    prompt_top: int | None = None  # echo with logprobs: the prompt's, with their top k
    tool_names: frozenset[str] = frozenset()  # chat: the names an untagged tool call may use
    max_calls: int | None = None  # chat: 1 with parallel_tool_calls false
    reasoning: str | None = None  # chat: the reasoning parser that splits the answer


class StreamOptions(Body):
    include_usage: bool = False
    include_obfuscation: Any = None
    NOT_IMPLEMENTED: ClassVar[dict[str, tuple[Any, ...]]] = {"include_obfuscation": (False,)}


class _OpenAIBody(SamplingKnobs):
    """Fields both OpenAI routes share (the OpenAI API's, then the extensions')."""

    model: str | None = None
    n: int = N_FIELD
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extensions: sglang's request id (the router sets it) and the PD router's fields
    rid: str | None = None
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None
    resume_ids: list[int] | None = None  # the router's, for a migrated request (Job.resume)
    # extensions known from vLLM / sglang, not implemented
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    include_stop_str_in_output: Any = None
    priority: Any = None
    # structured output (server/structured.py)
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    regex: Any = None
    json_schema: Any = None
    guided_grammar: Any = None
    ebnf: Any = None
    structured_outputs: Any = None
    return_tokens_as_token_ids: Any = None
    truncate_prompt_tokens: Any = None
    prompt_logprobs: Any = None
    lora_path: Any = None
    # sglang's, which sglang-router writes into every body it forwards (at their defaults)
    no_stop_trim: Any = None
    return_hidden_states: Any = None
    # sglang's, with a reasoning parser (--reasoning-parser): separate_reasoning false
    # leaves the reasoning in the content; stream_reasoning false is refused there
    # (ChatIn.reasoning_parser); without a parser, either value gives the same output
    separate_reasoning: Any = None
    stream_reasoning: Any = None
    NOT_IMPLEMENTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        **SamplingKnobs.NOT_IMPLEMENTED,
        "no_stop_trim": (False,),
        "return_hidden_states": (False,),
        "separate_reasoning": (True, False),
        "stream_reasoning": (True, False),
        "skip_special_tokens": (True,),
        "spaces_between_special_tokens": (True,),
        "include_stop_str_in_output": (False,),
        "priority": (0,),
        "return_tokens_as_token_ids": (False,),
        "truncate_prompt_tokens": (),
        "prompt_logprobs": (),
        "lora_path": (),
    }

    def check_fields(self, unknown: str = "refuse", where: str = "") -> None:
        super().check_fields(unknown, where)
        if self.stream_options is not None and not self.stream:
            raise FieldRefused("stream_options is only allowed with stream", "stream_options")

    def bootstrap(self) -> Bootstrap:
        return Bootstrap(self.bootstrap_host, self.bootstrap_port, self.bootstrap_room)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionIn(_OpenAIBody):
    prompt: Prompt
    # 0 only with echo: the prompt's logprobs alone (the engines sample one token, left out)
    max_tokens: int | None = Field(default=16, ge=0)
    # k: each token's logprob and the top k (openai_logprobs.py)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: Any = None
    NOT_IMPLEMENTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_OpenAIBody.NOT_IMPLEMENTED,
        "suffix": ("",),
    }

    def options(self) -> Options:
        """What the handler needs of the body beyond its plain fields, in one call."""
        return Options(self.bootstrap(), self.include_usage, self.engine_max_tokens, False,
                       self.logprobs or 0, self.prompt_top)  # fmt: skip

    def check_fields(self, unknown: str = "refuse", where: str = "") -> None:
        super().check_fields(unknown, where)
        if self.best_of is not None and self.best_of not in (1, self.n):
            raise FieldRefused("best_of other than n is not supported by this server", "best_of")
        if self.max_tokens == 0 and not self.echo:
            raise FieldRefused("max_tokens 0 needs echo (the response would be empty)",
                               "max_tokens")  # fmt: skip

    @property
    def engine_max_tokens(self) -> int | None:
        """max_tokens 0 asks the engines for 1: the prefill samples a first token anyway."""
        return 1 if self.max_tokens == 0 else self.max_tokens

    @property
    def prompt_top(self) -> int | None:
        """The top k of the prompt's logprobs the engines compute (echo with logprobs)."""
        return self.logprobs if self.echo else None


class TextPart(Body):
    """One part of a message's content; only text parts are implemented."""

    type: str
    text: str | None = None

    def check_fields(self, unknown: str = "refuse", where: str = "") -> None:
        if self.type != "text":
            raise FieldRefused(f"{where}type: content parts of type {self.type!r} are not "
                               "supported by this server (text only)", where + "type")  # fmt: skip
        if self.text is None:
            raise FieldRefused(f"{where}text is required in a text part", where + "text")
        super().check_fields(unknown, where)


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None
    audio: Any = None
    function_call: Any = None
    NOT_IMPLEMENTED: ClassVar[dict[str, tuple[Any, ...]]] = {"audio": (), "function_call": ()}


class ChatTemplateControls(Body):
    """The messages and how they are rendered (chat completions and /tokenize)."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    # extensions (vLLM's and sglang's chat template controls)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check_fields(self, unknown: str = "refuse", where: str = "") -> None:
        super().check_fields(unknown, where)
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldRefused("continue_final_message and add_generation_prompt cannot both "
                               "be true", "continue_final_message")  # fmt: skip
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise FieldRefused("continue_final_message needs a final assistant message",
                               "continue_final_message")  # fmt: skip


class ChatIn(ChatTemplateControls, _OpenAIBody):
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    # known, not implemented
    audio: Any = None
    function_call: Any = None
    functions: Any = None
    moderation: Any = None
    prediction: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    # extensions known, not implemented
    documents: Any = None
    chat_template: Any = None
    echo: Any = None
    NOT_IMPLEMENTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_OpenAIBody.NOT_IMPLEMENTED,
        "modalities": (["text"],),
        "service_tier": ("auto", "default"),
        "store": (False,),
        "audio": (),
        "function_call": (),
        "functions": (),
        "moderation": (),
        "prediction": (),
        "prompt_cache_options": (),
        "prompt_cache_retention": (),
        "reasoning_effort": (),
        "verbosity": (),
        "web_search_options": (),
        "documents": (),
        "chat_template": (),
        "echo": (False,),
    }

    def check_fields(self, unknown: str = "refuse", where: str = "") -> None:
        super().check_fields(unknown, where)
        if self.top_logprobs and not self.logprobs:  # as OpenAI: top_logprobs needs logprobs
            raise FieldRefused("top_logprobs needs logprobs true", "top_logprobs")
        choice = self.tool_choice
        named = isinstance(choice, dict) and choice.get("type") == "function"
        if choice not in (None, "none", "auto", "required") and not named:
            raise FieldRefused(f"tool_choice {_short(choice)} is not supported by this "
                               "server", "tool_choice")  # fmt: skip
        if choice not in (None, "none", "auto") and not self.tools:
            raise FieldRefused("tool_choice needs tools", "tool_choice")

    def parse_tools(self, parser: str | None) -> bool:
        """Whether the answer's tool calls are parsed: tools given and tool_choice "auto"
        (its default with tools); RequestError 400 when the model has no parser."""
        if not self.tools or self.tool_choice == "none":
            return False
        if parser not in (None, "hermes") and self.tool_choice != "auto":
            raise FieldRefused(f"tool_choice {_short(self.tool_choice)} is only forced for "
                               "the hermes tool-call format", "tool_choice")  # fmt: skip
        if parser is None:
            raise FieldRefused("this model's chat template shows no tool-call format this "
                               "server parses (see --tool-call-parser); send tool_choice "
                               '"none" to pass the tools to the template only', "tools")  # fmt: skip
        return True

    def options(self, tool_parser: str | None, reasoning_parser: str | None = None) -> Options:
        """What the handler needs of the body beyond its plain fields, in one call."""
        top = (self.top_logprobs or 0) if self.logprobs else 0
        return Options(self.bootstrap(), self.include_usage, self.max_output,
                       self.parse_tools(tool_parser), top, tool_names=self.tool_names,
                       max_calls=1 if self.parallel_tool_calls is False else None,
                       reasoning=self.reasoning_parser(reasoning_parser))  # fmt: skip

    def reasoning_parser(self, parser: str | None) -> str | None:
        """The server's reasoning parser, unless the request asks for no split."""
        if parser is None or self.separate_reasoning is False:
            return None
        if self.stream_reasoning is False:
            raise FieldRefused("stream_reasoning false (the reasoning sent only at the end) "
                               "is not supported by this server", "stream_reasoning")  # fmt: skip
        return parser

    @property
    def tool_names(self) -> frozenset[str]:
        """The names of the request's tools (what an untagged call must name)."""
        fns = [t.get("function") for t in self.tools or [] if isinstance(t, dict)]
        return frozenset(
            f["name"] for f in fns if isinstance(f, dict) and isinstance(f.get("name"), str)
        )

    @property
    def max_output(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens
