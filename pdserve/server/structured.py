"""Structured output requests into one llguidance grammar (the engines enforce it token by
token: pdserve.model.sampling.grammar).

    response_format {"type": "json_object"}               any JSON object
    response_format {"type": "json_schema", "json_schema": {"schema": ...}}
    guided_json / json_schema (vLLM's / sglang's)          a JSON schema (object or text)
    guided_regex / regex                                   a regular expression
    guided_choice                                          one of the given strings
    guided_grammar / ebnf (vLLM's / sglang's)              a grammar: Lark, or GBNF (EBNF)
    structured_outputs {json|regex|choice|grammar|json_object: ...}   vLLM's newer form

Why llguidance (not xgrammar): it computes a token mask on the CPU in about a millisecond
for a 49k vocabulary without a warm-up compile, builds from the `tokenizer.json` the
server already has (no transformers tokenizer object), ships one abi3 wheel with no
torch pin, and its schema compiler reports an unsupported schema with a message we can
hand back as the 400.
"""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance

from pdserve.server.request_fields import FieldRefused
from pdserve.server.tool_grammar import auto_tool_grammar, tool_grammar, tool_tags

# compact JSON: a small model is not left free to emit whitespace forever
_JSON_OPTIONS: Any = {"whitespace_flexible": False}


def _schema(value: Any, param: str) -> Any:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise FieldRefused(f"{param}: not JSON: {e}", param) from None
    if not isinstance(value, (dict, bool)):
        raise FieldRefused(f"{param} must be a JSON schema (an object)", param)
    return value


def from_response_format(rf: dict[str, Any] | None) -> str | None:
    kind = (rf or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_grammar({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = rf.get("json_schema") if rf else None
        if not isinstance(spec, dict) or "schema" not in spec:
            raise FieldRefused("response_format.json_schema.schema is required",
                               "response_format.json_schema")  # fmt: skip
        return json_grammar(_schema(spec["schema"], "response_format.json_schema.schema"),
                            "response_format.json_schema.schema")  # fmt: skip
    raise FieldRefused(f"response_format type {kind!r} is not supported", "response_format.type")


def json_grammar(schema: Any, param: str) -> str:
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except Exception as e:  # the compiler's own message names the problem
        raise FieldRefused(f"{param}: {e}", param) from None
    return checked(grammar, param)


def regex_grammar(regex: str, param: str) -> str:
    try:
        return checked(llguidance.LLMatcher.grammar_from_regex(regex), param)
    except FieldRefused:
        raise
    except Exception as e:
        raise FieldRefused(f"{param}: {e}", param) from None


def choice_grammar(choices: Any, param: str) -> str:
    if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
        raise FieldRefused(f"{param} must be a list of strings", param)
    return regex_grammar("|".join(f"({re.escape(c)})" for c in choices), param)


def cfg_grammar(text: Any, param: str) -> str:
    """A context-free grammar as the peers take it: Lark (llguidance's dialect) or
    llama.cpp's GBNF (`root ::= ...`), told apart and converted by llguidance."""
    if not isinstance(text, str) or not text.strip():
        raise FieldRefused(f"{param} must be a grammar (Lark or GBNF text)", param)
    try:
        grammar = llguidance.grammar_from("grammar", text)
    except Exception as e:  # the converter's own message names the line
        raise FieldRefused(f"{param}: {e}", param) from None
    return checked(grammar, param)


# vLLM's StructuredOutputsParams: the constraint kinds, and the options left at "off"
_SO_OFF: dict[str, tuple[Any, ...]] = {
    "disable_fallback": (False,), "disable_any_whitespace": (False,),
    "disable_additional_properties": (False,), "whitespace_pattern": (),
    "structural_tag": (),
}  # fmt: skip


def _structured_outputs(so: Any) -> list[tuple[str, str]]:
    """The asks in vLLM's `structured_outputs` object, each named `structured_outputs.X`."""
    if not isinstance(so, dict):
        raise FieldRefused("structured_outputs must be an object", "structured_outputs")
    asks: list[tuple[str, str]] = []
    for key, value in so.items():
        name = f"structured_outputs.{key}"
        if value is None:
            continue
        if key == "json":
            asks.append((name, json_grammar(_schema(value, name), name)))
        elif key == "regex":
            asks.append((name, regex_grammar(_text(value, name), name)))
        elif key == "choice":
            asks.append((name, choice_grammar(value, name)))
        elif key == "grammar":
            asks.append((name, cfg_grammar(value, name)))
        elif key == "json_object":
            if value is not True and value is not False:
                raise FieldRefused(f"{name} must be a boolean", name)
            if value:
                asks.append((name, json_grammar({"type": "object"}, name)))
        elif key not in _SO_OFF:
            raise FieldRefused(f"unknown field {name!r}", name)
        elif not any(type(value) is type(v) and value == v for v in _SO_OFF[key]):
            raise FieldRefused(f"{name} is not supported by this server", name)
    return asks


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise FieldRefused(f"{param} must be a string", param)
    return value


def checked(grammar: str, param: str) -> str:
    """`grammar` if llguidance compiles it, else FieldRefused naming the problem."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        raise FieldRefused(f"{param}: the grammar does not compile: {'; '.join(messages)}", param)
    return grammar


def request_grammar(body: Any, tok: Any = None) -> str | None:
    """The one grammar a request asks for (None: unconstrained); two asks are refused.
    `tok`: the server's Tokenizer, where tool calls may be forced."""
    asks: list[tuple[str, str]] = []
    rf = getattr(body, "response_format", None)
    if rf is not None and rf.get("type", "text") != "text":
        asks.append(("response_format", from_response_format(rf) or ""))
    for name in ("guided_json", "json_schema"):
        if getattr(body, name, None) is not None:
            asks.append((name, json_grammar(_schema(getattr(body, name), name), name)))
    for name in ("guided_regex", "regex"):
        value = getattr(body, name, None)
        if value is not None:
            asks.append((name, regex_grammar(_text(value, name), name)))
    if getattr(body, "guided_choice", None) is not None:
        asks.append(("guided_choice", choice_grammar(body.guided_choice, "guided_choice")))
    for name in ("guided_grammar", "ebnf"):
        if getattr(body, name, None) is not None:
            asks.append((name, cfg_grammar(getattr(body, name), name)))
    if getattr(body, "structured_outputs", None) is not None:
        asks += _structured_outputs(body.structured_outputs)
    asks += _tool_asks(body, tok, others=bool(asks))
    if len(asks) > 1:
        raise FieldRefused(f"only one of {', '.join(a for a, _ in asks)} may be given", asks[1][0])
    if asks and getattr(body, "ignore_eos", False):
        raise FieldRefused("ignore_eos cannot be combined with structured output", "ignore_eos")
    return asks[0][1] if asks else None


def _tool_asks(body: Any, tok: Any, others: bool) -> list[tuple[str, str]]:
    """The grammar tool_choice asks for: forced calls, or under "auto" strict arguments
    or a single call (tool_grammar.py); "auto" yields to another grammar (`others`),
    under which the answer holds no calls to constrain."""
    tools, choice = getattr(body, "tools", None), getattr(body, "tool_choice", None)
    if not tools or choice == "none":
        return []
    tags = tool_tags(tok) if tok is not None else None
    if choice not in (None, "auto"):
        return [("tool_choice", tool_grammar(tools, choice, body.parallel_tool_calls, tags))]
    if others:
        return []
    grammar = auto_tool_grammar(tools, body.parallel_tool_calls, tags)
    return [] if grammar is None else [("tools", grammar)]
