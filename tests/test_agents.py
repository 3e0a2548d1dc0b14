"""The agents' interface: tool calls in Qwen3.5's format and reasoning apart from content, parsed
from recorded outputs in every split of their text, forced by grammars, and served end to end by a
random checkpoint with a Qwen3.5-style chat template (shardspec.testing.chat_model)."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from llguidance import LLMatcher
from test_server import start_server
from tokenizers import Tokenizer

from shardspec.constraints import grammar_of, llg_tokenizer
from shardspec.layers.grammar import Constraint
from shardspec.server.api import ApiError, ChatBody, parse_body
from shardspec.server.chat import ChatTemplate
from shardspec.server.chat_output import ChatOutput, Delta
from shardspec.server.tools import Tool, calls_grammar, parse_tools, typed_value
from shardspec.testing.chat_model import ADDED_TOKENS, CHAT_TEMPLATE, chat_tokenizer, write_chat_model

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["c", "f"]},
        "detail": {"type": "object", "properties": {"wind": {"type": "boolean"}}, "required": ["wind"],
                   "additionalProperties": False},
        "hours": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23}, "maxItems": 3},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
NOTE = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 20}}, "required": ["text"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "take_note", "parameters": NOTE}}]
PARSED = [Tool("get_weather", WEATHER), Tool("take_note", NOTE)]
ADDED = frozenset(t["content"] for t in chat_tokenizer()["added_tokens"])

RECORDED = ("Paris is cold in winter.\nI should check.\n</think>\n\nLet me look that up.\n\n"
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=detail>\n{\"wind\": true}\n</parameter>\n"
            "<parameter=hours>\n[6, 12]\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=take_note>\n<parameter=text>\nline one\nline <b>two</b>\n</parameter>\n"
            "</function>\n</tool_call>")
RECORDED_CALLS = [("get_weather", {"city": "Paris", "days": 3, "detail": {"wind": True}, "hours": [6, 12]}),
                  ("take_note", {"text": "line one\nline <b>two</b>"})]


def split_streamed(text: str, cuts: list[int], reasoning: bool = True) -> Delta:
    output, total, start = ChatOutput(reasoning=reasoning, tools=PARSED), Delta(), 0
    for cut in [*cuts, len(text)]:
        total += output.feed(text[start:cut])
        start = cut
    total += output.finish()
    return total


def calls_of(delta: Delta) -> list[tuple[str, str]]:
    """(name, arguments) per call, the argument pieces of the deltas joined."""
    calls: dict[int, list[str]] = {}
    for entry in delta.tool_calls:
        name, arguments = calls.setdefault(entry["index"], ["", ""])
        calls[entry["index"]] = [name + entry["function"].get("name", ""), arguments + entry["function"]["arguments"]]
    return [(name, arguments) for name, arguments in calls.values()]


# --- parsing recorded outputs ---------------------------------------------------------------------


def test_a_recorded_output_splits_into_reasoning_content_and_typed_calls_in_every_split_of_its_text():
    whole = split_streamed(RECORDED, [])
    assert whole.reasoning == "Paris is cold in winter.\nI should check."
    assert whole.content == "Let me look that up."
    assert [(name, json.loads(args)) for name, args in calls_of(whole)] == RECORDED_CALLS
    expected = (whole.reasoning, whole.content, calls_of(whole))
    for cut in range(len(RECORDED) + 1):  # every place one cut can go, and a second one after it
        for second in range(cut, len(RECORDED) + 1, 11):
            got = split_streamed(RECORDED, [cut, second])
            assert (got.reasoning, got.content, calls_of(got)) == expected, (cut, second)
    one_by_one = split_streamed(RECORDED, list(range(1, len(RECORDED))))
    assert (one_by_one.reasoning, one_by_one.content, calls_of(one_by_one)) == expected


def test_each_call_streams_its_name_first_then_its_arguments_as_they_close():
    output = ChatOutput(tools=PARSED)
    head = output.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar")
    assert [(e["index"], e.get("id", "")[:5], e["function"]) for e in head.tool_calls] == [
        (0, "call_", {"name": "get_weather", "arguments": ""})]
    middle = output.feed("is\n</parameter>\n")
    assert middle.tool_calls == [{"index": 0, "function": {"arguments": '{"city": "Paris"'}}]
    end = output.feed("</function>\n</tool_call>")
    assert end.tool_calls == [{"index": 0, "function": {"arguments": "}"}}]
    assert output.calls[0].openai()["function"]["arguments"] == '{"city": "Paris"}'


@pytest.mark.parametrize(("raw", "schema", "value"), [
    ("\nParis\n", {"type": "string"}, "Paris"),
    ("\n 42 \n", {"type": "string"}, " 42 "),
    ("\n3\n", {"type": "integer"}, 3),
    ("\n3.0\n", {"type": "integer"}, 3),
    ("\n2.5\n", {"type": "number"}, 2.5),
    ("\nTrue\n", {"type": "boolean"}, True),
    ("\nfalse\n", {"type": "boolean"}, False),
    ('\n{"a": [1, null]}\n', {"type": "object"}, {"a": [1, None]}),
    ("\n[1, 2]\n", None, [1, 2]),
    ("\nnot json\n", None, "not json"),
    ("\nnull\n", {"type": ["string", "null"]}, None),
])
def test_parameter_values_take_their_declared_types(raw, schema, value):
    assert typed_value(raw, schema) == value


def test_an_unfinished_call_is_closed_with_what_it_had_and_a_block_without_a_function_is_content():
    cut = split_streamed("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<param",
                         [], reasoning=False)
    assert [(name, json.loads(args)) for name, args in calls_of(cut)] == [("get_weather", {"city": "Paris"})]
    nameless = split_streamed("Hi <tool_call>\nnothing here</tool_call> bye", [7], reasoning=False)
    assert nameless.content == "Hi <tool_call>\nnothing here bye" and not nameless.tool_calls
    untouched = ChatOutput(tools=None).whole("<tool_call>\n<function=f>\n</function>\n</tool_call>")
    assert untouched.content.startswith("<tool_call>") and not untouched.tool_calls


def test_a_call_made_inside_the_reasoning_is_a_call_not_reasoning():
    text = ("I will call.\n<tool_call>\n<function=take_note>\n<parameter=text>\nhi\n</parameter>\n</function>\n"
            "</tool_call>\nstill thinking")
    for cuts in ([], [15], [30, 31], list(range(1, len(text)))):
        split = split_streamed(text, cuts)
        assert (split.reasoning, split.content) == ("I will call.\n\nstill thinking", "")
        assert calls_of(split) == [("take_note", '{"text": "hi"}')]


def test_a_think_the_model_opens_itself_is_reasoning_only_at_the_start():
    opened = ChatOutput(thinks=True).whole("\n<think>\nhmm\n</think>\n\nanswer")
    assert (opened.reasoning, opened.content) == ("hmm", "answer")
    later = ChatOutput(thinks=True).whole("answer <think>x</think>")
    assert (later.reasoning, later.content) == ("", "answer <think>x</think>")
    for text in ("<b>hi</b> <think>x", "<thin> <think>x", "\n<br><think>x"):  # content that starts like a tag
        for cuts in ([], list(range(1, len(text)))):
            output, split = ChatOutput(thinks=True), Delta()
            for start, end in zip([0, *cuts], [*cuts, len(text)]):
                split += output.feed(text[start:end])
            split += output.finish()
            assert (split.reasoning, split.content) == ("", text.strip()), (text, cuts)


def test_a_parameter_value_holding_the_function_s_end_tag_streams_the_arguments_it_has_whole():
    text = ("<tool_call>\n<function=take_note>\n<parameter=text>\nend with </function> then\n</parameter>\n"
            "</function>\n</tool_call>")
    for cuts in ([], [60], [70, 80], list(range(1, len(text)))):
        split = split_streamed(text, cuts, reasoning=False)
        assert calls_of(split) == [("take_note", '{"text": "end with </function> then"}')], cuts
    after = ("<tool_call>\n<function=take_note>\n<parameter=text>\na\n</parameter>\n</function>\n"
             "<parameter=extra>\nb\n</parameter>\n</tool_call>")  # (a parameter after the call's end: not in it)
    for cuts in ([], [80], list(range(1, len(after)))):
        assert calls_of(split_streamed(after, cuts, reasoning=False)) == [("take_note", '{"text": "a"}')], cuts


@pytest.mark.parametrize("role", ["wizard", "function", "System"])
def test_a_message_of_a_role_templates_do_not_know_gets_a_400_and_developer_is_system(role):
    with pytest.raises(ApiError) as caught:
        parse_body(json.dumps({"messages": [{"role": role, "content": "x"}]}).encode(), ChatBody)
    assert caught.value.status == 400 and caught.value.param == "messages.0.role"
    developer = parse_body(b'{"messages": [{"role": "developer", "content": "be brief"}]}', ChatBody)
    assert developer.messages[0].for_template(0) == {"role": "system", "content": "be brief"}


# --- the template and the grammars ------------------------------------------------------------------


def template() -> ChatTemplate:
    return ChatTemplate(CHAT_TEMPLATE, {"eos_token": "<|im_end|>"})


def test_the_chat_template_renders_tools_calls_results_and_the_thinking_switch():
    chat = template()
    assert chat.writes_tool_calls
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    prompt = chat.render(messages, tools=TOOLS)
    assert prompt.startswith("<|im_start|>system\n# Tools") and json.dumps(TOOLS[0]) in prompt
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n" in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    closed = chat.render(messages[:1], kwargs={"enable_thinking": False})
    assert closed.endswith("<think>\n\n</think>\n\n")
    bundled = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}", {})
    assert not bundled.writes_tool_calls


@functools.cache
def tokenizers() -> tuple[Tokenizer, Any]:
    """The chat model's tokenizer, and llguidance's view of it."""
    tokenizer = chat_tokenizer()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "tokenizer.json"
        path.write_text(json.dumps(tokenizer))
        size = len(tokenizer["model"]["vocab"]) + len(ADDED_TOKENS)
        return Tokenizer.from_file(str(path)), llg_tokenizer(path, size, [tokenizer["added_tokens"][2]["id"]])


def matches(grammar: str, text: str) -> bool:
    """Whether the chat tokenizer's tokens of `text` are a complete match of `grammar`."""
    hf, llg = tokenizers()
    ids = hf.encode(text, add_special_tokens=False).ids
    matcher = LLMatcher(llg, grammar)
    assert not matcher.is_error(), matcher.get_error()
    return Constraint(matcher, []).advance(ids) == len(ids) and matcher.is_accepting()


def rendered_call(name: str, arguments: dict) -> str:
    """A call as the template writes it in an assistant turn."""
    text = template().render([{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": name, "arguments": arguments}}]}], add_generation_prompt=False)
    return text.split("<|im_start|>assistant\n")[1].removesuffix("<|im_end|>\n")


def test_the_forced_call_grammar_takes_the_template_s_calls_that_validate_and_no_other():
    grammar = calls_grammar(PARSED, parallel=True, tokens=ADDED)
    good = [("get_weather", {"city": "Oslo", "days": 7, "unit": "f", "hours": [1, 2]}),
            ("get_weather", {"city": "a\nb", "days": 1, "detail": {"wind": False}}),
            ("take_note", {"text": "<b>bold</b>"})]
    for name, arguments in good:
        jsonschema.validate(arguments, WEATHER if name == "get_weather" else NOTE)
        assert matches(grammar, rendered_call(name, arguments)), arguments
    assert matches(grammar, rendered_call(*good[0]) + "\n" + rendered_call(*good[2]))
    bad = [("get_weather", {"days": 2}), ("get_weather", {"city": "Oslo", "days": 8}),
           ("get_weather", {"city": "Oslo", "days": 2, "unit": "k"}),
           ("get_weather", {"city": "Oslo", "days": 2, "extra": 1}),
           ("get_weather", {"city": "a very long city name", "days": 2}),
           ("get_weather", {"city": "Oslo", "days": 2, "hours": [1, 2, 3, 4]}),
           ("send_mail", {"to": "x"})]
    for name, arguments in bad:
        assert not matches(grammar, rendered_call(name, arguments)), arguments
    single = calls_grammar(PARSED[1:], parallel=False, tokens=ADDED)
    assert not matches(single, rendered_call(*good[2]) + "\n" + rendered_call(*good[2]))
    assert not matches(single, rendered_call(*good[0]))


def test_a_string_parameter_s_pattern_holds_in_a_forced_call_as_ecma_262_reads_it():
    def grammar(pattern: str, kind: str | list[str] = "string") -> str:
        schema = {"type": "object", "properties": {"code": {"type": kind, "pattern": pattern}}}
        return calls_grammar(parse_tools([{"type": "function", "function": {"name": "f", "parameters": schema}}]),
                             parallel=False, tokens=ADDED)

    def takes(pattern: str, value: str | None, kind: str | list[str] = "string") -> bool:
        return matches(grammar(pattern, kind), rendered_call("f", {"code": value}))

    # (ASCII values without line ends: where Python's re, jsonschema's, reads a pattern as ECMA-262 does)
    for pattern, value, valid in [("^[A-Z][a-z]+$", "Paris", True), ("^[A-Z][a-z]+$", "paris", False),
                                  ("^[A-Z][a-z]+$", "Paris1", False), ("[0-9]{3}", "ab123c", True),
                                  ("[0-9]{3}", "ab12c", False), ("^a|b$", "axx", True), ("^a|b$", "xxb", True),
                                  ("^a|b$", "bxa", False), ("^a/b$", "a/b", True), (r"a\\$", "xa\\", True),
                                  (r"a\\$", "a\\x", False), ("^[^/]+$", "a/b", False), (r"(^$|^\d+$)", "12", True),
                                  (r"(^$|^\d+$)", "1a", False), (r"(?:^x|y$)", "xa", True), (r"[\d_]+", "_", True)]:
        assert takes(pattern, value) is valid is bool(jsonschema.Draft202012Validator(
            {"pattern": pattern}).is_valid(value)), (pattern, value)
    # ECMA-262's own: \d and \w are ASCII, `.` is no line terminator (Python's re reads all three otherwise)
    for pattern, value in [(r"^\d+$", "١٢٣"), (r"^\w+$", "é"), ("^a.b$", "a\rb")]:
        assert not takes(pattern, value), (pattern, value)
    assert takes("^[A-Z]+$", None, ["string", "null"]) and not takes("^[A-Z]+$", None)  # (null is written null)
    with pytest.raises(ApiError) as caught:
        grammar("a(^b)")
    assert caught.value.param == "tools[0].function.parameters.properties.code.pattern"
    parse_tools([{"type": "function", "function": {"name": "f", "parameters": {  # (a call not forced: no grammar)
        "type": "object", "properties": {"code": {"type": "string", "pattern": "a(^b)"}}}}}])


def test_a_constraint_after_reasoning_is_free_until_the_marker_token_and_holds_after_it():
    grammar = grammar_of({"json": NOTE, "after": "</think>"}, ADDED)
    assert matches(grammar, 'free {"not": json} text\n</think>\n\n{"text":"hi"}')
    assert not matches(grammar, 'free text</think>\n\nnot json')
    assert not matches(grammar, '{"text":"hi"}')  # no end of the reasoning: the JSON is not the answer


# --- served ---------------------------------------------------------------------------------------

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    """The chat model on one local CPU worker, MTP on."""
    folder = tmp_path_factory.mktemp("agents")
    write_chat_model(folder / "model")
    started = start_server(folder, "--model", str(folder / "model"), "--local", "1", "--max-seq-len", "1024")
    yield started
    assert started.stop() == 0, started.log.read_text(errors="replace")


def call(client: openai.OpenAI, **kwargs):
    request = {"model": client.models.list().data[0].id, "messages": ASK, "tools": TOOLS, "max_tokens": 160,
               "temperature": 1.0, "extra_body": NO_THINKING}
    return client.chat.completions.create(**(request | kwargs))


def streamed(client: openai.OpenAI, **kwargs) -> tuple[list[tuple[str, str]], str, str | None]:
    """(name, arguments) per call, the content and the finish reason of a streamed completion; every
    chunk says something (a delta, an end)."""
    calls: dict[int, list[str]] = {}
    content, finish = "", None
    for chunk in call(client, stream=True, **kwargs):
        delta = chunk.choices[0].delta
        assert delta.model_dump(exclude_none=True) or chunk.choices[0].finish_reason, chunk
        content += delta.content or ""
        for entry in delta.tool_calls or []:
            name, arguments = calls.setdefault(entry.index, ["", ""])
            calls[entry.index] = [name + (entry.function.name or ""), arguments + (entry.function.arguments or "")]
        finish = chunk.choices[0].finish_reason or finish
    return [(n, a) for n, a in calls.values()], content, finish


@pytest.mark.parametrize("choice", [pytest.param("required", marks=pytest.mark.slow),
                                    {"type": "function", "function": {"name": "take_note"}}])
def test_forced_calls_sampled_at_temperature_1_parse_validate_and_stream_as_they_return(chat_server, choice):
    client = chat_server.client()
    for seed in range(3):  # (room for the random model's optional properties: 160 tokens cut one call short)
        reply = call(client, tool_choice=choice, parallel_tool_calls=False, seed=seed, max_tokens=400).choices[0]
        assert reply.finish_reason == "tool_calls" and len(reply.message.tool_calls) == 1
        function = reply.message.tool_calls[0].function
        assert isinstance(choice, str) or function.name == "take_note"
        jsonschema.validate(json.loads(function.arguments), WEATHER if function.name == "get_weather" else NOTE)
        assert streamed(client, tool_choice=choice, parallel_tool_calls=False, seed=seed, max_tokens=400) == (
            [(function.name, function.arguments)], "", "tool_calls")


@pytest.mark.slow
def test_parallel_required_calls_all_validate(chat_server):
    reply = call(chat_server.client(), tool_choice="required", seed=3, max_tokens=400).choices[0]
    assert reply.message.tool_calls
    for tool_call in reply.message.tool_calls:
        schema = WEATHER if tool_call.function.name == "get_weather" else NOTE
        arguments = json.loads(tool_call.function.arguments)
        if reply.finish_reason == "tool_calls" or tool_call is not reply.message.tool_calls[-1]:
            jsonschema.validate(arguments, schema)


@pytest.mark.slow
def test_reasoning_comes_apart_from_content_streamed_and_not_and_a_json_format_holds_after_it(chat_server):
    """The model's </think> made likely (logit_bias), so that reasoning ends; the JSON format holds
    for the content only."""
    client = chat_server.client()
    model = client.models.list().data[0].id
    end_of_reasoning = chat_tokenizer()["added_tokens"][4]["id"]
    kwargs = {"model": model, "messages": ASK, "max_tokens": 120, "temperature": 1.0, "seed": 5,
              "logit_bias": {str(end_of_reasoning): 6.0}, "response_format": {"type": "json_object"}}
    message = client.chat.completions.create(**kwargs).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and "</think>" not in reasoning and "</think>" not in message.content
    assert isinstance(json.loads(message.content), dict)
    pieces = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        pieces["content"] += delta.content or ""
        pieces["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
    assert pieces == {"reasoning_content": reasoning, "content": message.content}


@pytest.mark.parametrize(("kwargs", "param", "words"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among"),
    ({"tool_choice": "sometimes"}, "tool_choice", "required"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", "64"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters", "object"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "cannot both"),
    ({"extra_body": {"chat_template_kwargs": {"messages": []}}}, "chat_template_kwargs", "messages"),
])
def test_bad_tool_requests_get_a_400_naming_the_problem(chat_server, kwargs, param, words):
    client = chat_server.client()
    request = {"model": client.models.list().data[0].id, "messages": ASK, "max_tokens": 4, "tools": TOOLS} | kwargs
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**request)
    assert caught.value.body["param"] == param and words in caught.value.body["message"], caught.value.body


@pytest.mark.slow
def test_a_conversation_with_a_tool_result_goes_on_and_tool_choice_none_leaves_calls_as_text(chat_server):
    client = chat_server.client()
    first = call(client, tool_choice={"type": "function", "function": {"name": "get_weather"}}, seed=1,
                 parallel_tool_calls=False).choices[0].message
    history = [*ASK, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny, 21 C"}]
    model = client.models.list().data[0].id
    after = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=8, temperature=0,
                                           extra_body=NO_THINKING, tool_choice="none")
    assert after.usage.prompt_tokens > call(client, max_tokens=1).usage.prompt_tokens
    assert after.choices[0].message.tool_calls is None


def test_metrics_count_the_tokens_a_grammar_left_no_choice_for(chat_server):
    """A named call's opening (<tool_call>, the function's name, its first parameter's name) has one
    continuation only: those tokens count as forced (jump-forward), among the grammar's tokens."""
    def counts() -> tuple[float, float]:
        text = httpx.get(chat_server.root + "/metrics").text
        values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("shardspec_grammar"))
        return float(values["shardspec_grammar_tokens_total"]), float(values["shardspec_grammar_forced_tokens_total"])

    before = counts()
    reply = call(chat_server.client(), tool_choice={"type": "function", "function": {"name": "take_note"}}, seed=2,
                 parallel_tool_calls=False)
    grammar, forced = (a - b for a, b in zip(counts(), before))
    assert reply.usage.completion_tokens == grammar
    assert 8 <= forced < grammar
