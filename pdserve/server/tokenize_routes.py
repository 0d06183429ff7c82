"""`/tokenize` and `/detokenize` in vLLM's shapes.

POST /tokenize    {"prompt": str, "add_special_tokens": true, "return_token_strs": false}
               or {"messages": [...], chat template controls as in chat completions}
               -> {"count", "max_model_len", "tokens", "token_strs"}
POST /detokenize  {"tokens": [int, ...]} -> {"prompt": str}
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdserve.server.generation import Frontend
from pdserve.server.http_util import check_api_key, read_json
from pdserve.server.jobs import RequestError
from pdserve.server.openai_api import ChatTemplateControls
from pdserve.server.openai_parse import chat_prompt_ids, check_model, parse_body
from pdserve.server.request_fields import Body
from pdserve.server.server_config import ServerConfig


class _Tokenize(Body):
    model: str | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    return_token_strs: bool = False


class TokenizePrompt(_Tokenize):
    prompt: str


class TokenizeChat(ChatTemplateControls, _Tokenize):
    pass


class DetokenizeIn(Body):
    model: str | None = None
    tokens: list[int]


def register(app: FastAPI, fe: Frontend, cfg: ServerConfig) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        check_api_key(request, cfg.api_key)
        data = await read_json(request, cfg.max_body_bytes)
        chat = isinstance(data, dict) and "messages" in data
        body: TokenizePrompt | TokenizeChat
        if chat:
            body = parse_body(TokenizeChat, data, cfg)
            check_model(body.model, cfg)
            ids = chat_prompt_ids(fe, body)
            if body.add_special_tokens:  # the template wrote the special tokens already
                raise RequestError("add_special_tokens with messages is not supported",
                                   "add_special_tokens")  # fmt: skip
        else:
            body = parse_body(TokenizePrompt, data, cfg)
            check_model(body.model, cfg)
            ids = fe.tokenizer.encode(body.prompt, body.add_special_tokens is not False)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": fe.max_context,
                               "tokens": ids, "token_strs": None}  # fmt: skip
        if body.return_token_strs:
            out["token_strs"] = [fe.tokenizer.hf.id_to_token(t) for t in ids]
        return JSONResponse(out)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        check_api_key(request, cfg.api_key)
        body = parse_body(DetokenizeIn, await read_json(request, cfg.max_body_bytes), cfg)
        check_model(body.model, cfg)
        bad = [t for t in body.tokens if not 0 <= t < fe.tokenizer.vocab_size]
        if bad:
            raise RequestError(f"token ids outside the vocabulary: {bad[:8]}", "tokens")
        return JSONResponse({"prompt": fe.tokenizer.decode(body.tokens)})
