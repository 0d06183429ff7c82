"""Structured output: response_format (json_object / json_schema) and the regex / choice
extensions, enforced token by token by llguidance in the engines' sampler.

The schema checks run without a model; the end-to-end test serves SmolLM2 through the
whole PD path (`pdserve up`: router -> prefill -> KV -> decode) and asks the `openai`
client's `chat.completions.parse` for pydantic models, streaming and not."""

from __future__ import annotations

import enum
import json
import re

import openai
import pydantic
import pytest

from pdserve.server.request_fields import FieldRefused
from pdserve.server.structured import (
    cfg_grammar,
    choice_grammar,
    from_response_format,
    json_grammar,
    request_grammar,
)


def test_schemas_that_do_not_compile_are_refused_by_name() -> None:
    with pytest.raises(FieldRefused) as e:
        json_grammar({"type": "nonsense"}, "response_format.json_schema.schema")
    assert e.value.param == "response_format.json_schema.schema" and "nonsense" in e.value.message
    with pytest.raises(FieldRefused) as e:
        from_response_format({"type": "json_schema", "json_schema": {"name": "x"}})
    assert e.value.param == "response_format.json_schema"
    with pytest.raises(FieldRefused) as e:
        from_response_format({"type": "yaml"})
    assert e.value.param == "response_format.type"
    with pytest.raises(FieldRefused):
        choice_grammar([], "guided_choice")
    assert from_response_format({"type": "text"}) is None
    assert json.loads(from_response_format({"type": "json_object"}) or "")["grammars"]


YES_NO_GBNF = 'root ::= answer "."\nanswer ::= "yes" | "no"'
YES_NO_LARK = 'start: answer "."\nanswer: "yes" | "no"'


@pytest.fixture(scope="module")
def accepts(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """accepts(grammar, text): whether `grammar` takes `text` whole, on a test vocabulary."""
    import llguidance
    from fake_engine import make_model_dir

    from pdserve.server.tokenizer import Tokenizer

    model = make_model_dir(tmp_path_factory.mktemp("model"))
    tok = llguidance.LLTokenizer((model / "tokenizer.json").read_text(), eos_token=0)
    ours = Tokenizer(model)

    def run(grammar: str, text: str) -> bool:
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        return m.consume_tokens(ours.encode(text, add_special_tokens=False)) and m.is_accepting()

    return run


class _Body:
    def __init__(self, **kw: object) -> None:
        self.__dict__.update(kw)


def test_grammars_lark_and_gbnf(accepts) -> None:
    """vLLM's guided_grammar / structured_outputs.grammar and sglang's ebnf take Lark or
    llama.cpp's GBNF; a grammar that does not compile is refused naming the field."""
    for text in (YES_NO_GBNF, YES_NO_LARK):
        g = cfg_grammar(text, "guided_grammar")
        assert accepts(g, "yes.") and accepts(g, "no.") and not accepts(g, "maybe.")
    for bad, why in [("root ::= (", "Expected ')'"), ("start: foo", "unknown name"),
                     ("", "must be a grammar"), (3, "must be a grammar")]:  # fmt: skip
        with pytest.raises(FieldRefused) as e:
            cfg_grammar(bad, "ebnf")
        assert e.value.param == "ebnf" and why in e.value.message, e.value.message


def test_structured_outputs_object(accepts) -> None:
    """vLLM's `structured_outputs`: one constraint, options at their defaults."""
    so = lambda **kw: request_grammar(_Body(structured_outputs=kw))  # noqa: E731
    assert accepts(so(grammar=YES_NO_LARK), "no.")
    assert accepts(so(regex="[0-9]{3}"), "123") and not accepts(so(regex="[0-9]{3}"), "12a")
    assert accepts(so(choice=["red", "blue"]), "blue")
    assert accepts(so(json={"type": "object", "properties": {"a": {"type": "integer"}}}), '{"a":1}')
    assert accepts(so(json_object=True, disable_fallback=False), '{"x":[1]}')
    assert so(json_object=False) is None and so(regex=None) is None
    for kw, param in [({"grammar": "root ::= ("}, "structured_outputs.grammar"),
                      ({"structural_tag": "{}"}, "structured_outputs.structural_tag"),
                      ({"disable_any_whitespace": True}, "structured_outputs.disable_any_whitespace"),
                      ({"colour": 1}, "structured_outputs.colour"),
                      ({"regex": "a", "choice": ["b"]}, "structured_outputs.choice")]:  # fmt: skip
        with pytest.raises(FieldRefused) as e:
            so(**kw)
        assert e.value.param == param, e.value.message
    with pytest.raises(FieldRefused) as e:
        request_grammar(_Body(guided_grammar=YES_NO_LARK, structured_outputs={"regex": "a"}))
    assert e.value.param == "structured_outputs.regex"


# ---- SmolLM2 through the PD path -----------------------------------------------------------
class Colour(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    population: int
    coastal: bool


class Point(pydantic.BaseModel):
    x: float
    y: float


class Shape(pydantic.BaseModel):
    """Nested objects, an enum, an array, numbers; bounded, as a small model needs."""

    colour: Colour
    corners: list[Point] = pydantic.Field(min_length=3, max_length=3)
    label: str = pydantic.Field(max_length=16)


MAX = 120  # schema answers end well before (the grammar then allows only EOS)


@pytest.fixture(scope="module")
def client(smollm2_stack) -> openai.OpenAI:
    """The session's SmolLM2 stack (tests/smollm2_stack.py), with the hermes tool-call
    parser named (SmolLM2's template shows no format)."""
    return openai.OpenAI(base_url=smollm2_stack.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)  # fmt: skip


def ask(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


@pytest.mark.parametrize(
    ("model", "question"),
    [(City, "Describe Lisbon."), (Shape, "Describe a blue triangle with its corners.")],
)
def test_parse_returns_the_pydantic_object(client, model, question) -> None:
    r = client.chat.completions.parse(model="smollm2", messages=ask(question),
                                      response_format=model, max_tokens=MAX, temperature=0)  # fmt: skip
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, model), r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def test_parse_streamed(client) -> None:
    with client.chat.completions.stream(model="smollm2", messages=ask("Describe Oslo."),
                                        response_format=City, max_tokens=MAX,
                                        temperature=0.7, seed=11) as s:  # fmt: skip
        for _ in s:
            pass
        final = s.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, City)


def test_json_object_and_regex(client) -> None:
    r = client.chat.completions.create(model="smollm2", messages=ask('Reply {"ok": true}'),
                                       response_format={"type": "json_object"},
                                       max_tokens=MAX, temperature=0)  # fmt: skip
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    r = client.chat.completions.create(model="smollm2", messages=ask("A date?"), max_tokens=20,
                                       temperature=0, extra_body={"guided_regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}"})  # fmt: skip
    assert re.fullmatch("[0-9]{4}-[0-9]{2}-[0-9]{2}", r.choices[0].message.content or "")
    r = client.completions.create(model="smollm2", prompt="The sky is", max_tokens=10,
                                  temperature=0.9, seed=1,
                                  extra_body={"guided_choice": ["blue", "green"]})  # fmt: skip
    assert r.choices[0].text in ("blue", "green")
    q = ask("Is the sky blue? Answer yes or no.")
    for extra in [{"guided_grammar": YES_NO_GBNF}, {"ebnf": YES_NO_LARK},
                  {"structured_outputs": {"grammar": YES_NO_LARK}}]:  # fmt: skip
        r = client.chat.completions.create(model="smollm2", messages=q, max_tokens=8,
                                           temperature=0, extra_body=extra)  # fmt: skip
        assert r.choices[0].message.content in ("yes.", "no."), (extra, r.choices[0])
        assert r.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=q, max_tokens=8,
                                       extra_body={"guided_grammar": "root ::= ("})  # fmt: skip
    assert e.value.param == "guided_grammar" and "Expected" in str(e.value)


def test_a_bad_schema_is_a_400_through_the_router(client) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=ask("x"), max_tokens=5,
                                       response_format={"type": "json_schema", "json_schema":
                                                        {"name": "x", "schema": {"type": "bogus"}}})  # fmt: skip
    assert e.value.param == "response_format.json_schema.schema"


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}},
]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_call_parses(client, stream) -> None:
    """tool_choice names a function: the grammar forces a well-formed call, and the
    parser returns it as tool_calls; the tool's result goes back as a role-tool message."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    msgs = ask("What is the weather in Paris?")
    kw = {"model": "smollm2", "tools": TOOLS, "tool_choice": choice, "max_tokens": MAX,
          "temperature": 0, "parallel_tool_calls": False}  # fmt: skip
    if stream:
        chunks = list(client.chat.completions.create(messages=msgs, stream=True, **kw))
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    else:
        r = client.chat.completions.create(messages=msgs, **kw)
        calls = r.choices[0].message.tool_calls or []
        assert r.choices[0].finish_reason == "tool_calls"
    (call,) = calls
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    msgs += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]  # fmt: skip
    r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=10,
                                       temperature=0, tools=TOOLS, tool_choice="none")  # fmt: skip
    assert r.choices[0].message.content
