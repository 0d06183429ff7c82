"""An OpenAI request into one OpenAIRequest (the Job for the engine and how to answer):
reading and parsing the body with the field policy, the model check, the prompt ids
(the chat template's too, shared with /tokenize), the sampling parameters."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from fastapi import Request

from pdserve.server.chat_output import ChatOutput
from pdserve.server.chat_template import continue_final_message
from pdserve.server.generation import Frontend
from pdserve.server.http_util import parse, read_model
from pdserve.server.jobs import Bootstrap, Job, RequestError
from pdserve.server.openai_api import ChatIn, ChatMessage, ChatTemplateControls, CompletionIn
from pdserve.server.request_fields import Body, FieldRefused
from pdserve.server.server_config import ServerConfig
from pdserve.server.structured import request_grammar
from pdserve.server.tokenizer import ChatTemplateError

B = TypeVar("B", bound=Body)
# names the chat template gets from the request itself, not from chat_template_kwargs
RESERVED_TEMPLATE_NAMES = {"messages", "tools", "documents", "add_generation_prompt"}
MAX_CHOICES = 256  # prompts × n of one request


@dataclass(frozen=True)
class OpenAIRequest:
    """One parsed OpenAI request: what the engine runs and how the answer is shaped."""

    job: Job
    stream: bool
    include_usage: bool
    logprobs: bool
    out: ChatOutput = ChatOutput()  # how a chat answer is split (chat_output.py)
    echo: list[str] | None = None  # each prompt's text, put before its choices (completions)
    drop_output: bool = False  # max_tokens 0: the engines sample one token the answer leaves out


async def read_completion(request: Request, fe: Frontend, cfg: ServerConfig,
                          stamps: dict[str, float]) -> OpenAIRequest:  # fmt: skip
    body = await read_body(request, CompletionIn, cfg)
    opts = body.options()
    logprobs = body.logprobs is not None
    prompts = completion_prompts(fe, body.prompt)
    job = make_job(fe, body, prompts, opts.max_tokens, logprobs, stamps, opts.boot,
                   opts.top, opts.prompt_top)  # fmt: skip
    echo = echo_texts(fe, body.prompt, prompts) if body.echo else None
    return OpenAIRequest(job, body.stream, opts.include_usage, logprobs, echo=echo,
                         drop_output=body.max_tokens == 0)  # fmt: skip


async def read_chat(request: Request, fe: Frontend, cfg: ServerConfig, stamps: dict[str, float],
                    tool_parser: str | None) -> OpenAIRequest:  # fmt: skip
    body = await read_body(request, ChatIn, cfg)
    return chat_request(fe, cfg, body, stamps, tool_parser)


def chat_request(fe: Frontend, cfg: ServerConfig, body: ChatIn, stamps: dict[str, float],
                 tool_parser: str | None) -> OpenAIRequest:  # fmt: skip
    """A checked chat body as the request the engine runs, under the server's settings
    `cfg` (the Responses and Messages routes build a ChatIn and come here too)."""
    opts = body.options(tool_parser, cfg.reasoning_parser)
    prompts = [chat_prompt_ids(fe, body)]
    job = make_job(fe, body, prompts, opts.max_tokens, body.logprobs, stamps, opts.boot, opts.top)
    out = ChatOutput(opts.tools, opts.tool_names, opts.max_calls, opts.reasoning)
    return OpenAIRequest(job, body.stream, opts.include_usage, body.logprobs, out)


async def read_body(request: Request, model: type[B], cfg: ServerConfig) -> B:
    """The key checked, the body read and parsed (parse_body), the model checked."""
    body = await read_model(request, model, cfg.api_key, cfg.max_body_bytes)
    checked(body, cfg)
    check_model(getattr(body, "model", None), cfg)
    return body


def make_job(fe: Frontend, body: CompletionIn | ChatIn, prompts: list[list[int]],
             wanted: int | None, logprobs: bool, stamps: dict[str, float],
             boot: Bootstrap, top: int = 0, prompt_top: int | None = None) -> Job:  # fmt: skip
    """`top`: the top k logprobs of each output token; `prompt_top`: the prompt's logprobs
    with their top k (None: not asked)."""
    if len(prompts) * body.n > MAX_CHOICES:
        raise RequestError(f"a request may make at most {MAX_CHOICES} choices (prompts × n)", "n")
    # one max_tokens for the batch: the smallest any prompt allows when none is given
    max_tokens = min(fe.check_prompt(ids, wanted, prompt_top) for ids in prompts)
    params = body.params(max_tokens, logprobs, top, prompt_top)
    grammar = request_grammar(body, fe.tokenizer)
    if grammar is not None:
        params = msgspec.structs.replace(params, grammar=grammar)
    return Job(prompts, params, body.n, body.rid, boot, stamps, list(body.resume_ids or ()))


def parse_body(model: type[B], data: Any, cfg: ServerConfig) -> B:
    """The validated body; RequestError 400 naming a field refused (request_fields.py)."""
    return checked(parse(model, data), cfg)


def checked(body: B, cfg: ServerConfig) -> B:
    try:
        body.check_fields(cfg.unknown_fields)
    except FieldRefused as e:
        raise RequestError(str(e), e.param) from e
    return body


def check_model(model: str | None, cfg: ServerConfig) -> None:
    """A request naming a model must name ours (served name or path); 404 otherwise."""
    if model is not None and model not in (cfg.model_name, cfg.model_path):
        raise RequestError(f"model {model!r} does not exist; this server serves "
                           f"{cfg.model_name!r}", "model", status=404)  # fmt: skip


def echo_texts(fe: Frontend, prompt: Any, prompts: list[list[int]]) -> list[str]:
    """Each prompt's text for echo: as sent when it was text, else decoded from its ids."""
    texts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], str) else [prompt]  # fmt: skip
    if all(isinstance(t, str) for t in texts) and len(texts) == len(prompts):
        return list(texts)
    return [fe.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]


def completion_prompts(fe: Frontend, prompt: Any) -> list[list[int]]:
    """A string, a list of token ids, or a batch (a list) of those."""
    batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]  # fmt: skip
    out = [fe.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in batch]
    if not out:
        raise RequestError("the prompt is empty", "prompt")
    return out


def chat_prompt_ids(fe: Frontend, body: ChatTemplateControls) -> list[int]:
    messages = [template_message(m) for m in body.messages]
    kwargs = dict(body.chat_template_kwargs or {})
    taken = sorted(kwargs.keys() & RESERVED_TEMPLATE_NAMES)
    if taken:
        raise RequestError(f"chat_template_kwargs may not set {taken[0]!r} (a request field "
                           "sets it)", "chat_template_kwargs")  # fmt: skip
    try:
        text = fe.tokenizer.apply_chat_template(
            messages, tools=body.tools, add_generation_prompt=body.add_generation_prompt, **kwargs
        )
        if body.continue_final_message:
            text = continue_final_message(text, messages[-1]["content"] or "")
    except ChatTemplateError as e:
        raise RequestError(str(e), "messages") from e
    return fe.tokenizer.encode(text, add_special_tokens=False)


def template_message(m: ChatMessage) -> dict[str, Any]:
    """The message as chat templates read it (a developer message is a system one)."""
    role = "system" if m.role == "developer" else m.role
    text = "".join(p.text or "" for p in m.content) if isinstance(m.content, list) else m.content
    out = {"role": role, "content": text, "name": m.name, "tool_calls": template_calls(m.tool_calls),
           "tool_call_id": m.tool_call_id, "reasoning_content": m.reasoning_content}  # fmt: skip
    # a null content (an assistant turn that only calls tools) is rendered as "", which
    # every template reads; transformers would drop the key and many templates fail
    out["content"] = out["content"] or ""
    return {k: v for k, v in out.items() if v is not None}


def template_calls(calls: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tool calls with `function.arguments` as an object: OpenAI sends it as JSON text,
    templates write it with `tojson` (as transformers and vLLM expect), which would quote
    the text a second time; text that is not JSON stays as it was."""
    if not calls:
        return calls
    out = []
    for call in calls:
        fn = call.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                call = {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
            except json.JSONDecodeError:
                pass
        out.append(call)
    return out
