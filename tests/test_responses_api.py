"""/v1/responses (OpenAI's Responses API) on `shardspec serve` with the chat-template test model,
driven by the official `openai` client: input items, tools, reasoning, structured output, the
streamed events, previous_response_id, and the openai-agents SDK's default model class."""

from __future__ import annotations

import importlib.util
import json

import httpx
import jsonschema
import openai
import pytest
from served_chat import leave_a_stream, served

from shardspec.server.response_store import ResponseStore

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 3},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather.", "parameters": CITY,
          "strict": True}]
FORCED = {"tools": TOOLS, "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False}
NO_REASONING = {"reasoning": {"effort": "none"}}
ALL_TOKENS = {"extra_body": {"ignore_eos": True}}  # (a greedy random model may end at once)
FORECAST = {"type": "object", "properties": {"sky": {"enum": ["sunny", "rainy"]},
                                             "high": {"type": "integer", "minimum": -9, "maximum": 40}},
            "required": ["sky", "high"], "additionalProperties": False}


chat_server = served()


@pytest.fixture(scope="module")
def client(chat_server) -> openai.OpenAI:
    return chat_server.client()


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def create(client: openai.OpenAI, model: str, seed: int | None = None, **kwargs):
    """A response (`seed`: not OpenAI's, sent in the body as chat completions takes it)."""
    if seed is not None:
        kwargs["extra_body"] = kwargs.get("extra_body", {}) | {"seed": seed}
    return client.responses.create(**({"model": model, "input": "What is the weather in Paris?",
                                       "max_output_tokens": 8, "temperature": 0.0} | kwargs))


def streamed(client: openai.OpenAI, model: str, **kwargs) -> tuple[list, object]:
    """(every event, the final response) of a streamed response."""
    events = list(create(client, model, stream=True, **kwargs))
    return events, events[-1].response


def test_a_text_response_streamed_and_not_gives_the_same_output_and_usage(client, model):
    whole = create(client, model, **NO_REASONING, **ALL_TOKENS)
    events, final = streamed(client, model, **NO_REASONING, **ALL_TOKENS)
    assert whole.status == final.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in whole.output] == ["message"]
    assert whole.output[-1].status == final.output[-1].status == "incomplete"  # (cut off)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert whole.output_text == final.output_text == deltas != ""
    assert whole.usage.output_tokens == final.usage.output_tokens == 8
    assert whole.usage.input_tokens == final.usage.input_tokens
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert [e.type for e in events if e.type != "response.output_text.delta"][2:] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.incomplete"]


def test_a_forced_call_streams_its_arguments_and_they_validate_against_the_tool_s_schema(client, model):
    whole = create(client, model, max_output_tokens=60, temperature=1.0, seed=4, **FORCED, **NO_REASONING)
    assert whole.status == "completed" and [item.type for item in whole.output] == ["function_call"]
    call = whole.output[0]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), CITY)
    events, final = streamed(client, model, max_output_tokens=60, temperature=1.0, seed=4, **FORCED, **NO_REASONING)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments == final.output[0].arguments == call.arguments
    assert events[-1].type == "response.completed" and call.status == final.output[0].status == "completed"
    cut = create(client, model, max_output_tokens=3, temperature=1.0, seed=4, **FORCED, **NO_REASONING)
    assert cut.status == "incomplete" and cut.output[-1].status == "incomplete", cut.output


def test_previous_response_id_continues_as_the_whole_conversation_sent_again_does(client, model):
    first = create(client, model, max_output_tokens=60, seed=1, **FORCED, **NO_REASONING)
    call = first.output[0]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    chained = create(client, model, previous_response_id=first.id, input=[result], max_output_tokens=4, tools=TOOLS,
                     **NO_REASONING)
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               *[item.model_dump(exclude_none=True) for item in first.output], result]
    resent = create(client, model, input=history, max_output_tokens=4, tools=TOOLS, **NO_REASONING)
    assert chained.previous_response_id == first.id
    assert chained.usage.input_tokens == resent.usage.input_tokens > first.usage.input_tokens
    assert chained.output_text == resent.output_text


def test_input_items_of_every_kind_make_the_prompt_the_same_chat_messages_make(chat_server, client, model):
    arguments = json.dumps({"city": "Paris", "days": 2})
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                             "text": "I should call."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": arguments},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    reply = create(client, model, instructions="You forecast.", input=items, tools=TOOLS, max_output_tokens=1)
    messages = [{"role": "system", "content": "You forecast."}, {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "reasoning_content": "I should call.", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather.",
                                               "parameters": CITY, "strict": True}}]
    counted = httpx.post(f"{chat_server.root}/tokenize", json={"messages": messages, "tools": tools}, timeout=60)
    assert reply.usage.input_tokens == counted.json()["count"]


def test_an_unknown_unstored_or_another_key_s_previous_response_id_is_a_400(chat_server, client, model):
    unstored = create(client, model, max_output_tokens=2, store=False)
    stored = create(client, model, max_output_tokens=2)
    other_key = openai.OpenAI(base_url=chat_server.url, api_key="another", max_retries=0)
    for asking, previous in [(client, "resp_unknown"), (client, unstored.id), (other_key, stored.id)]:
        with pytest.raises(openai.BadRequestError) as caught:
            create(asking, model, previous_response_id=previous, max_output_tokens=2)
        assert caught.value.body["param"] == "previous_response_id"
        assert caught.value.body["code"] == "previous_response_not_found", caught.value.body
    assert create(client, model, previous_response_id=stored.id, max_output_tokens=2).status == "incomplete"


def test_a_stored_response_is_retrieved_and_deleted_by_its_id(client, model, chat_server):
    made = create(client, model, max_output_tokens=3)
    assert client.responses.retrieve(made.id).output_text == made.output_text
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    again = httpx.delete(f"{chat_server.url}/responses/{made.id}")  # (as curl -X DELETE sends it: no body, no type)
    assert again.status_code == 404 and again.json()["error"]["message"], again.text


def test_the_store_drops_the_least_recently_used_response_beyond_its_count_or_its_bytes():
    store = ResponseStore(max_responses=3, max_bytes=1000)
    item = [{"type": "message", "role": "user", "content": "x" * 100}]
    for key in "abc":
        assert store.put(key, "me", item, {"id": key})
    assert store.get("a", "me") is not None  # a is now the most recently used
    store.put("d", "me", item, {"id": "d"})
    assert sorted(store.entries) == ["a", "c", "d"]
    store.put("e", "me", [{"content": "x" * 800}], {"id": "e"})  # over the bytes: the oldest go
    assert list(store.entries) == ["d", "e"] and store.bytes <= 1000
    assert not store.put("f", "me", [{"content": "x" * 2000}], {})  # larger than the whole store
    assert store.get("d", "someone else") is None and store.get("d", "me") is not None


def test_text_format_json_schema_gives_json_of_the_schema_streamed_and_not(client, model):
    fmt = {"text": {"format": {"type": "json_schema", "name": "forecast", "schema": FORECAST, "strict": True}}}
    whole = create(client, model, max_output_tokens=60, temperature=1.0, seed=2, **fmt, **NO_REASONING)
    jsonschema.validate(json.loads(whole.output_text), FORECAST)
    assert whole.status == "completed" and whole.text.format.type == "json_schema"
    _, final = streamed(client, model, max_output_tokens=60, temperature=1.0, seed=2, **fmt, **NO_REASONING)
    assert final.output_text == whole.output_text


def test_reasoning_effort_is_the_template_s_thinking_switch_and_reasoning_comes_as_its_own_item(client, model):
    thinking = create(client, model, max_output_tokens=6)  # the template opens <think>: the output starts inside
    silent = create(client, model, max_output_tokens=6, **NO_REASONING)
    assert thinking.output[0].type == "reasoning" and thinking.output[0].content[0].text
    assert thinking.usage.output_tokens_details.reasoning_tokens > 0
    assert [item.type for item in silent.output] == ["message"]
    assert silent.usage.input_tokens > thinking.usage.input_tokens  # (the closed <think></think> of the prompt)
    events, final = streamed(client, model, max_output_tokens=6)
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == final.output[0].content[0].text == thinking.output[0].content[0].text


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"input": [{"type": "computer_call", "call_id": "c"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, "input[0].arguments"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"truncation": "auto"}, "truncation"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"reasoning": {"effort": "none"}, "extra_body": {"chat_template_kwargs": {"enable_thinking": True}}},
     "reasoning.effort"),
    ({"extra_body": {"top_k": -1}}, "top_k"),
    ({"extra_body": {"unknown_thing": 1}}, "unknown_thing"),
])
def test_bad_requests_get_a_4xx_in_openai_s_shape_naming_the_param(client, model, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, model, **kwargs)
    assert caught.value.body["param"] == param, caught.value.body
    assert caught.value.body["type"] == "invalid_request_error"


def test_structured_outputs_and_chat_template_kwargs_are_taken_as_chat_completions_takes_them(client, model):
    extras = {"structured_outputs": {"choice": ["yes", "no"]}, "chat_template_kwargs": {"enable_thinking": False}}
    choice = create(client, model, max_output_tokens=10, extra_body=extras)
    assert choice.output_text in ("yes", "no") and choice.status == "completed"
    raw = httpx.post(f"{client.base_url}responses", json={"model": model, "input": "hi", "max_output_tokens": 2,
                                                          "cache_salt": "tenant-a"}, timeout=60)
    assert raw.status_code == 200 and raw.json()["usage"]["output_tokens"] == 2


def test_a_client_that_leaves_a_streamed_response_frees_its_sequence(chat_server, model):
    body = {"model": model, "input": "hi", "max_output_tokens": 400, "stream": True, "ignore_eos": True,
            "reasoning": {"effort": "none"}}
    stats, cancelled = leave_a_stream(chat_server, f"{chat_server.url}/responses", body, "output_text.delta")
    assert stats["live_sequences"] == [] and stats["slots_free"] == stats["slots_total"]
    assert cancelled == 1  # (not run to its end)


@pytest.mark.skipif(importlib.util.find_spec("agents") is None, reason="the openai-agents SDK is not installed "
                    "(pip install openai-agents)")
def test_the_agents_sdk_s_default_model_runs_a_tool_using_agent_to_its_output_type(chat_server, model):
    """tools/agents_check.py's check: the agent's tool ran, and its output is of its output type."""
    import agents_check  # (tools/, on the path from conftest.py)

    assert "the tool ran with" in agents_check.check_openai_agents(chat_server.url, model)
