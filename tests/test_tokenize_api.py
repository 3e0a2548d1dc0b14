"""/tokenize and /detokenize as vLLM has them, on `shardspec serve` with the chat-template test model:
the counts are those of the prompts the generation routes build."""

from __future__ import annotations

import httpx
import openai
import pytest
from served_chat import served

from shardspec.orchestrator.tokenizer import Tokenizer

CONTEXT = 512
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


chat_server = served(CONTEXT)


@pytest.fixture(scope="module")
def model(chat_server) -> str:
    return chat_server.client().models.list().data[0].id


def post(chat_server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{chat_server.root}/{route}", json=body, timeout=60)


def test_a_prompt_s_count_and_tokens_are_those_a_completion_uses(chat_server, model):
    prompt = "def fibonacci(n):\n    return n"
    reply = post(chat_server, "tokenize", {"model": model, "prompt": prompt, "return_token_strs": True}).json()
    tokenizer = Tokenizer.from_folder(chat_server.model)
    assert reply["tokens"] == tokenizer.encode(prompt) and reply["count"] == len(reply["tokens"])
    assert reply["max_model_len"] == CONTEXT
    assert reply["token_strs"] == [tokenizer.inner.id_to_token(i) for i in reply["tokens"]]
    completion = chat_server.client().completions.create(model=model, prompt=prompt, max_tokens=1)
    assert completion.usage.prompt_tokens == reply["count"]


@pytest.mark.parametrize("kwargs", [{}, {"tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}}])
def test_messages_count_as_the_prompt_of_their_chat_completion(chat_server, model, kwargs):
    reply = post(chat_server, "tokenize", {"model": model, "messages": MESSAGES, **kwargs}).json()
    extra = {"chat_template_kwargs": kwargs["chat_template_kwargs"]} if kwargs else {}
    chat = chat_server.client().chat.completions.create(model=model, messages=MESSAGES, max_tokens=1,
                                                        tools=kwargs.get("tools", openai.NOT_GIVEN), extra_body=extra)
    assert reply["count"] == chat.usage.prompt_tokens == len(reply["tokens"])
    assert reply["token_strs"] is None


def test_without_the_generation_prompt_messages_count_fewer_tokens(chat_server, model):
    body = {"model": model, "messages": MESSAGES}
    with_prompt = post(chat_server, "tokenize", body).json()
    without = post(chat_server, "tokenize", body | {"add_generation_prompt": False}).json()
    assert without["tokens"] == with_prompt["tokens"][: without["count"]] and without["count"] < with_prompt["count"]


def test_detokenize_gives_back_the_text_of_the_tokens(chat_server, model):
    text = "import os\nprint(os.getcwd())"
    tokens = post(chat_server, "tokenize", {"prompt": text})
    assert post(chat_server, "detokenize", {"model": model, "tokens": tokens.json()["tokens"]}).json() == {
        "prompt": text}


@pytest.mark.parametrize(("route", "body", "status", "param"), [
    ("tokenize", {"prompt": "x", "messages": MESSAGES}, 400, "prompt"),
    ("tokenize", {}, 400, "prompt"),
    ("tokenize", {"prompt": "def f(x):\n    return x\n" * 400}, 400, "prompt"),
    ("tokenize", {"messages": [{"role": "user", "content": 3}]}, 400, "messages.0.content"),
    ("tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message"),
    ("tokenize", {"prompt": "x", "model": "nope"}, 404, "model"),
    ("tokenize", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400,
     "tools[0].function.name"),  # (what a generation refuses is not counted either)
    ("tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("detokenize", {"tokens": [0, 10**9]}, 400, "tokens"),
    ("detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("detokenize", {"tokens": "12"}, 400, "tokens"),
])
def test_bad_requests_get_a_4xx_naming_the_param(chat_server, route, body, status, param):
    reply = post(chat_server, route, body)
    assert reply.status_code == status and reply.json()["error"]["param"] == param, reply.text
