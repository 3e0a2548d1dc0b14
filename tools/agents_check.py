"""Agent frameworks users know, unchanged, against `shardspec serve`.

    pip install langchain-openai openai-agents anthropic
    python tools/agents_check.py [--model DIR] [--url URL] [--only CHECK]

Without --url it writes a random-weight checkpoint with a Qwen3.5-style chat template
(shardspec.testing.chat_model) to a temporary folder, serves it on one local worker with MTP, runs
the checks and stops the server. Its text is not language (random weights), so the checks are of
the interface: what the grammars guarantee (valid structured output, calls of the declared tools
with valid arguments) and that each framework's own loop runs to its end. (Strings have a
maxLength: a random model would not end a free one within max_tokens.)

  openai         structured output (a Pydantic model through `beta.chat.completions.parse`), and a
                 tool loop: a forced call, the tool's result sent back as role "tool", a reply
  langchain      `ChatOpenAI.with_structured_output(Model)` and `bind_tools` with a tool loop
  openai-agents  the SDK's default model class (OpenAIResponsesModel, /v1/responses): an `Agent` with a
                 `function_tool` that its first turn must call and an output type (structured output
                 through text.format) that its last turn answers in
  openai-agents-chat  the same agent's tool loop on OpenAIChatCompletionsModel (/v1/chat/completions)
  anthropic      the `anthropic` client's tool loop (/v1/messages): a forced tool_use, its tool_result
                 sent back, a reply

Each check prints one line, OK or FAIL with the reason; the exit status is the number of failures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, Field

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


City = Annotated[str, Field(max_length=12)]
Days = Annotated[int, Field(ge=1, le=7)]


class Weather(BaseModel):
    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)
    unit: str = Field(pattern="^(c|f)$", max_length=1)


def get_weather(city: str, days: int) -> str:
    """The weather in a city for the next days."""
    return f"sunny in {city} for {days} days"


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city for the next days.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}


# --- the checks -------------------------------------------------------------------------------------


def check_openai(url: str, model: str) -> str:
    import openai

    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    parsed = client.beta.chat.completions.parse(model=model, messages=[{"role": "user", "content": "Weather?"}],
                                                response_format=Weather, max_tokens=80, extra_body=NO_THINKING)
    weather = parsed.choices[0].message.parsed
    assert isinstance(weather, Weather), parsed
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER_TOOL], max_tokens=80,
                                           tool_choice="required", parallel_tool_calls=False, extra_body=NO_THINKING)
    call = first.choices[0].message.tool_calls[0]
    result = get_weather(**json.loads(call.function.arguments))
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": result}]
    final = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER_TOOL], max_tokens=16,
                                           extra_body=NO_THINKING)
    return f"parsed {weather!r}; called {call.function.name}{call.function.arguments}; then " \
           f"{final.choices[0].finish_reason!r} after the tool's result"


def check_langchain(url: str, model: str) -> str:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=url, api_key="unused", model=model, max_tokens=80, max_retries=0,
                     extra_body=NO_THINKING)
    weather = llm.with_structured_output(Weather).invoke("What is the weather in Oslo?")
    assert isinstance(weather, Weather), weather

    @tool
    def weather_tool(city: City, days: Days) -> str:
        """The weather in a city for the next days."""
        return get_weather(city, days)

    bound = llm.bind_tools([weather_tool], tool_choice="weather_tool")
    messages = [HumanMessage("What is the weather in Rome?")]
    reply = bound.invoke(messages)
    assert reply.tool_calls, reply
    call = reply.tool_calls[0]
    messages += [reply, ToolMessage(weather_tool.invoke(call["args"]), tool_call_id=call["id"])]
    final = llm.bind_tools([weather_tool]).invoke(messages)
    return f"structured {weather!r}; called {call['name']}({call['args']}); then {len(final.content)} characters"


def recorded_weather_tool(calls: list[tuple[str, int]]):
    """The weather function as an openai-agents tool that records its calls; tracing off (its traces
    would go to OpenAI's servers)."""
    from agents import function_tool, set_tracing_disabled

    set_tracing_disabled(True)

    @function_tool
    def weather(city: City, days: Days) -> str:
        """The weather in a city for the next days."""
        calls.append((city, days))
        return get_weather(city, days)

    return weather


def check_openai_agents(url: str, model: str) -> str:
    import openai
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner
    from openai.types.shared import Reasoning

    calls: list[tuple[str, int]] = []
    weather = recorded_weather_tool(calls)
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
    # the first turn must call (tool_choice; the SDK resets it after a call), the last answers in the output
    # type, whose grammar ends the text; reasoning effort "none" turns the template's thinking off
    settings = ModelSettings(tool_choice="weather", parallel_tool_calls=False, max_tokens=120,
                             reasoning=Reasoning(effort="none"))
    agent = Agent(name="forecaster", instructions="Answer with the weather tool.", tools=[weather],
                  output_type=Weather, model=OpenAIResponsesModel(model=model, openai_client=client),
                  model_settings=settings)
    result = asyncio.run(Runner.run(agent, "What is the weather in Lima?", max_turns=4))
    assert calls, "the agent never called its tool"
    assert isinstance(result.final_output, Weather), result.final_output
    return f"the tool ran with {calls[0]}; the final output is {result.final_output!r} after " \
           f"{len(result.raw_responses)} responses"


def check_openai_agents_chat(url: str, model: str) -> str:
    import openai
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner

    calls: list[tuple[str, int]] = []
    weather = recorded_weather_tool(calls)
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
    agent = Agent(name="forecaster", instructions="Answer with the weather tool.", tools=[weather],
                  model=OpenAIChatCompletionsModel(model=model, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", max_tokens=80, extra_body=NO_THINKING))
    result = asyncio.run(Runner.run(agent, "What is the weather in Lima?", max_turns=4))
    assert calls, "the agent never called its tool"
    return f"the tool ran with {calls[0]}; the run ended after {len(result.raw_responses)} model calls"


def check_anthropic(url: str, model: str) -> str:
    import anthropic

    client = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="unused", max_retries=0)
    tool = {"name": "get_weather", "description": "The weather in a city for the next days.",
            "input_schema": WEATHER_TOOL["function"]["parameters"]}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(model=model, max_tokens=80, messages=messages, tools=[tool],
                                   tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},  # noqa: E501
                                   thinking={"type": "disabled"})
    assert first.stop_reason == "tool_use", first
    use = next(block for block in first.content if block.type == "tool_use")
    messages += [{"role": "assistant", "content": [block.model_dump() for block in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": get_weather(**use.input)}]}]
    final = client.messages.create(model=model, max_tokens=16, messages=messages, tools=[tool],
                                   thinking={"type": "disabled"})
    return f"called {use.name}({use.input}); then {final.stop_reason!r} after the tool's result"


CHECKS: dict[str, Callable[[str, str], str]] = {
    "openai": check_openai, "langchain": check_langchain, "openai-agents": check_openai_agents,
    "openai-agents-chat": check_openai_agents_chat, "anthropic": check_anthropic}


# --- the server -------------------------------------------------------------------------------------


def serve(model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "shardspec", "serve", "--model", str(model), "--local", "1", "--port", "0",
           "--max-seq-len", "2048"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while not (found := re.search(r"serving \S+ at (http://\S+)", log.read_text(errors="replace"))):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the server did not start:\n{log.read_text(errors='replace')}")
        time.sleep(0.2)
    return proc, found.group(1)


def run_checks(url: str, names: list[str]) -> int:
    import openai

    model = openai.OpenAI(base_url=url, api_key="unused").models.list().data[0].id
    failures = 0
    for name in names:
        try:
            print(f"OK    {name}: {CHECKS[name](url, model)}", flush=True)
        except Exception as exc:  # a check's failure is reported, the others still run
            failures += 1
            print(f"FAIL  {name}: {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc(limit=3)
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--model", type=Path, help="a checkpoint folder to serve (default: a random chat model)")
    parser.add_argument("--url", help="check a server already running at this /v1 URL instead of starting one")
    parser.add_argument("--only", choices=list(CHECKS), action="append", help="run this check (repeatable; "
                        "default: all)")
    args = parser.parse_args()
    names = args.only or list(CHECKS)
    if args.url:
        raise SystemExit(run_checks(args.url, names))
    with tempfile.TemporaryDirectory() as folder:
        model = args.model
        if model is None:
            from shardspec.testing.chat_model import write_chat_model

            model = write_chat_model(Path(folder) / "chat-model")
        proc, url = serve(model, Path(folder) / "server.log")
        try:
            failures = run_checks(url, names)
        finally:
            proc.terminate()
            proc.wait(60)
    raise SystemExit(failures)


if __name__ == "__main__":
    main()
