"""/v1/messages (Anthropic's Messages API) on `shardspec serve` with the chat-template test model,
driven by the official `anthropic` client: content blocks, a tool loop, thinking, stop sequences,
the streamed events, count_tokens, and errors in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from served_chat import leave_a_stream, served

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 3},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The weather.", "input_schema": CITY}]
FORCED = {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}}
NO_THINKING = {"thinking": {"type": "disabled"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ALL_TOKENS = {"extra_body": {"ignore_eos": True}}  # (a greedy random model may end at once)


chat_server = served()


@pytest.fixture(scope="module")
def client(chat_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=chat_server.root, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(chat_server) -> str:
    return chat_server.client().models.list().data[0].id


def request(model: str, temperature: float = 0.0, seed: int | None = None, **kwargs) -> dict:
    """A request's arguments; sampling goes in the body (this client version has no temperature)."""
    extra = kwargs.pop("extra_body", {}) | {"temperature": temperature} | ({} if seed is None else {"seed": seed})
    return {"model": model, "max_tokens": 8, "messages": ASK, "extra_body": extra} | kwargs


def create(client: anthropic.Anthropic, model: str, **kwargs):
    return client.messages.create(**request(model, **kwargs))


def streamed(client: anthropic.Anthropic, model: str, **kwargs):
    """(the events' types, the final message) of a streamed message, accumulated by the client."""
    with client.messages.stream(**request(model, **kwargs)) as stream:
        types = [event.type for event in stream]
        return types, stream.get_final_message()


def test_a_text_message_streamed_and_not_gives_the_same_content_and_usage(client, model):
    whole = create(client, model, **NO_THINKING, **ALL_TOKENS)
    types, final = streamed(client, model, **NO_THINKING, **ALL_TOKENS)
    assert whole.stop_reason == final.stop_reason == "max_tokens"
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in whole.content]
    assert whole.usage.output_tokens == final.usage.output_tokens == 8
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == \
        final.usage.input_tokens + final.usage.cache_read_input_tokens
    raw = [t for t in types if t not in ("text", "content_block_delta")]  # ("text": the client's own event)
    assert raw == ["message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"]


def test_a_tool_loop_calls_with_valid_input_and_goes_on_after_the_tool_result(client, model):
    first = create(client, model, max_tokens=60, temperature=1.0, **FORCED, **NO_THINKING)
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["tool_use"]
    use = first.content[0]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, CITY)
    history = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"},
                                            {"type": "text", "text": "And tomorrow?"}]}]
    after = create(client, model, messages=history, tools=TOOLS, **NO_THINKING)
    assert after.usage.input_tokens + after.usage.cache_read_input_tokens > \
        first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.output_tokens


def test_a_streamed_tool_use_s_input_json_deltas_build_the_input_of_the_whole_message(client, model):
    extra = {"max_tokens": 60, "temperature": 1.0, "seed": 3, **FORCED, **NO_THINKING}
    whole = create(client, model, **extra)
    types, final = streamed(client, model, **extra)
    assert final.content[0].input == whole.content[0].input and final.stop_reason == "tool_use"
    assert "content_block_delta" in types  # (input_json_delta: the client builds the input from them)


def test_thinking_enabled_gives_a_thinking_block_first_and_disabled_none(client, model):
    thinking = create(client, model, max_tokens=4, thinking={"type": "enabled", "budget_tokens": 1024})
    silent = create(client, model, max_tokens=4, **NO_THINKING)
    assert thinking.content[0].type == "thinking" and thinking.content[0].thinking
    assert all(block.type != "thinking" for block in silent.content)
    _, final = streamed(client, model, max_tokens=4, thinking={"type": "enabled", "budget_tokens": 1024})
    assert final.content[0].thinking == thinking.content[0].thinking


def test_a_stop_sequence_ends_the_text_before_it_and_is_named_in_the_stop_reason(client, model):
    text = create(client, model, max_tokens=16, **NO_THINKING, **ALL_TOKENS).content[0].text
    stop = text.strip()[4:7]
    assert stop.strip(), text
    stopped = create(client, model, max_tokens=16, stop_sequences=[stop], **NO_THINKING, **ALL_TOKENS)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert text.strip().startswith(stopped.content[0].text.strip()) and stop not in stopped.content[0].text


def test_output_config_s_json_schema_gives_json_of_the_schema(client, model):
    schema = {"type": "object", "properties": {"sky": {"enum": ["sunny", "rainy"]}}, "required": ["sky"],
              "additionalProperties": False}
    reply = create(client, model, max_tokens=40, temperature=1.0, seed=2, **NO_THINKING,
                   output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(reply.content[0].text), schema)
    assert reply.stop_reason == "end_turn"


def test_content_blocks_of_every_kind_make_the_prompt_the_same_chat_messages_make(chat_server, client, model):
    history = [{"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
               {"role": "assistant", "content": [
                   {"type": "thinking", "thinking": "I should call.", "signature": ""},
                   {"type": "text", "text": "Let me see."},
                   {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris", "days": 2}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"},
                                            {"type": "text", "text": "Thanks."}]}]
    counted = client.messages.count_tokens(model=model, system="You forecast.", messages=history, tools=TOOLS)
    messages = [{"role": "system", "content": "You forecast."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Let me see.", "reasoning_content": "I should call.", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {
                        "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, {"role": "user", "content": "Thanks."}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather.",
                                               "parameters": CITY}}]
    chat = httpx.post(f"{chat_server.root}/tokenize", json={"messages": messages, "tools": tools}, timeout=60)
    assert counted.input_tokens == chat.json()["count"]


def test_a_system_prompt_as_a_string_or_as_blocks_makes_the_same_prompt(client, model):
    as_text = client.messages.count_tokens(model=model, messages=ASK, system="Be brief.")
    as_blocks = client.messages.count_tokens(model=model, messages=ASK, system=[{"type": "text", "text": "Be brief."}])
    without = client.messages.count_tokens(model=model, messages=ASK)
    assert as_text.input_tokens == as_blocks.input_tokens > without.input_tokens


def test_count_tokens_counts_the_prompt_a_message_is_generated_from(client, model):
    kwargs = {"messages": ASK, "system": "Be brief.", **FORCED, **NO_THINKING}
    counted = client.messages.count_tokens(model=model, **kwargs).input_tokens
    usage = create(client, model, max_tokens=60, **kwargs).usage
    assert counted == usage.input_tokens + usage.cache_read_input_tokens


def test_a_client_that_leaves_a_streamed_message_frees_its_sequence(chat_server, model):
    body = {"model": model, "messages": ASK, "max_tokens": 400, "stream": True, "ignore_eos": True, **NO_THINKING}
    stats, cancelled = leave_a_stream(chat_server, f"{chat_server.root}/v1/messages", body, "text_delta")
    assert stats["live_sequences"] == [] and stats["slots_free"] == stats["slots_total"]
    assert cancelled == 1  # (not run to its end)


@pytest.mark.parametrize(("body", "status", "kind", "words"), [
    ({"messages": ASK}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 0, "messages": ASK}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error", "image"),
    ({"max_tokens": 4, "messages": [*ASK, {"role": "assistant", "content": "It is"}]}, 400, "invalid_request_error",
     "prefill"),
    ({"max_tokens": 4, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "invalid_request_error", "tools[0]"),
    ({"max_tokens": 4, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, 400,
     "invalid_request_error", "not among"),
    ({"max_tokens": 4, "messages": ASK, "thinking": {"type": "sometimes"}}, 400, "invalid_request_error",
     "thinking.type"),
    ({"max_tokens": 4, "messages": ASK, "stop_sequences": ["a", "b", "c", "d", "e"]}, 400, "invalid_request_error",
     "stop_sequences"),
    ({"max_tokens": 4, "messages": ASK, "model": "claude-opus"}, 404, "not_found_error", "claude-opus"),
])
def test_bad_requests_get_a_4xx_in_anthropic_s_shape(chat_server, model, body, status, kind, words):
    reply = httpx.post(f"{chat_server.root}/v1/messages", json={"model": model} | body, timeout=60)
    assert reply.status_code == status, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and words in error["error"]["message"], error


def test_the_anthropic_client_raises_its_own_errors(client, model):
    with pytest.raises(anthropic.BadRequestError):
        create(client, model, messages=[])
    with pytest.raises(anthropic.NotFoundError):
        create(client, "claude-opus")


def test_a_body_over_the_limit_gets_an_anthropic_shaped_413(chat_server, model):
    reply = httpx.post(f"{chat_server.root}/v1/messages", content=b"{" + b" " * (5 << 20) + b"}",
                       headers={"content-type": "application/json"}, timeout=60)
    assert reply.status_code == 413 and reply.json()["error"]["type"] == "request_too_large", reply.text
