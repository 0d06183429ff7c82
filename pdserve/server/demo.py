"""What `pdserve up` prints once the stack is ready (the URL, the console, a curl to
try) and `pdserve demo`'s one question, asked through the router's chat API as any
OpenAI client would ask it and streamed to the terminal."""

from __future__ import annotations

import argparse
import json
from typing import Any

import httpx

from pdserve.server.launch_children import Child

DEMO_QUESTION = "What is the capital of France?"


def _base(args: argparse.Namespace) -> str:
    return f"http://{args.host}:{args.port}"


def _model_name(args: argparse.Namespace) -> str:
    try:
        r = httpx.get(_base(args) + "/v1/models", headers=_auth(args), timeout=5)
        return str(r.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return "default"


def _auth(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def _chat_body(args: argparse.Namespace, max_tokens: int, stream: bool) -> dict[str, Any]:
    messages = [{"role": "user", "content": DEMO_QUESTION}]
    return {"model": _model_name(args), "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}  # fmt: skip


def print_ready(args: argparse.Namespace, children: list[Child], log_dir: str) -> None:
    body = json.dumps(_chat_body(args, 64, stream=False))
    key = " -H 'Authorization: Bearer $PDSERVE_API_KEY'" if args.api_key else ""
    workers = ", ".join(f"{c.name} {c.url}" for c in children if c.name != "router")
    print(f"pdserve is up at {_base(args)}  ({workers}; logs in {log_dir})")
    if not getattr(args, "no_web_ui", False):
        print(f"Web console: {_base(args)}/")
    print("Try:")
    print(
        f"  curl {_base(args)}/v1/chat/completions -H 'Content-Type: application/json'{key} "
        f"-d '{body}'"
    )
    print("Ctrl-C stops every server.", flush=True)


def stream_demo(args: argparse.Namespace) -> None:
    """Ask one question through the router's chat API; stream the answer to the terminal."""
    print(f"\nQ: {DEMO_QUESTION}\nA: ", end="", flush=True)
    with httpx.stream(
        "POST",
        _base(args) + "/v1/chat/completions",
        json=_chat_body(args, 128, stream=True),
        headers=_auth(args),
        timeout=300,
    ) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                print(choice.get("delta", {}).get("content") or "", end="", flush=True)
    print("\n\n(still serving; Ctrl-C stops)", flush=True)
