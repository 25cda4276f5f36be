"""One third-party client against a live `roofline serve`: run by bench/clients_check.py with the Python of the
clients' own venv (these packages are not the project's dependencies), one case per process.

    python bench/clients_cases.py --base-url http://127.0.0.1:PORT/v1 --case openai.chat
    python bench/clients_cases.py --list

Prints one JSON line: {"ok": bool, "detail": str, "requests": int | null}. `ok` says the protocol worked (the
client parsed what came back, streams ended, an agent loop ended with an answer within its limit), not that the
tiny model's answer is right. Everything goes to the given loopback address only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

ASK = "What is the capital of France? Answer in one word."
WEATHER_Q = "What's the weather in Paris?"
MAX_ROUNDS = 5  # an agent loop that has not answered after this many model calls never ends


def get_weather(city: str) -> str:
    """Current weather in a city."""
    return f"18 degrees and sunny in {city}"


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def result(ok: bool, detail: str, requests: int | None = None) -> dict[str, Any]:
    return {"ok": ok, "detail": detail.replace("\n", " ")[:160], "requests": requests}


def short(text: str | None) -> str:
    text = (text or "").strip().replace("\n", " ")
    return repr(text if len(text) <= 50 else text[:47] + "...")


# ---- openai --------------------------------------------------------------------------------------------------


def openai_client(base: str) -> Any:
    import openai

    return openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)


def openai_chat(base: str) -> dict:
    r = openai_client(base).chat.completions.create(model="default", messages=[{"role": "user", "content": ASK}],
                                                     max_tokens=16, temperature=0)
    return result(bool(r.choices[0].message.content), f"reply {short(r.choices[0].message.content)}", 1)


def openai_stream(base: str) -> dict:
    chunks = list(openai_client(base).chat.completions.create(
        model="default", messages=[{"role": "user", "content": ASK}], max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices)
    usage = chunks[-1].usage
    ok = bool(text) and finish in ("stop", "length") and usage is not None
    return result(ok, f"{len(chunks)} chunks, finish {finish}, usage {usage.completion_tokens if usage else None}", 1)


def chat_tools_loop(create: Any) -> dict:
    """The agent loop by hand: call, run the tool, send the result back, until the model answers. `create(messages)`
    is the client's chat call with the weather tool offered; it returns an OpenAI-shaped response."""
    messages: list[Any] = [{"role": "user", "content": WEATHER_Q}]
    for rounds in range(1, MAX_ROUNDS + 1):
        msg = create(messages).choices[0].message
        if not msg.tool_calls:
            return result(True, f"answered after {rounds - 1} call(s): {short(msg.content)}", rounds)
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": get_weather(**json.loads(call.function.arguments))})
    return result(False, f"still calling after {MAX_ROUNDS} rounds", MAX_ROUNDS)


def openai_tools_loop(base: str) -> dict:
    client = openai_client(base)
    return chat_tools_loop(lambda messages: client.chat.completions.create(
        model="default", messages=messages, tools=[WEATHER_TOOL], max_tokens=64, temperature=0))


def openai_parse(base: str) -> dict:
    import pydantic

    class City(pydantic.BaseModel):
        city: str
        country: str

    r = openai_client(base).chat.completions.parse(model="default", messages=[{"role": "user", "content": ASK}],
                                                    response_format=City, max_tokens=48, temperature=0)
    parsed = r.choices[0].message.parsed
    return result(isinstance(parsed, City), f"parsed {parsed!r}", 1)


def openai_responses_loop(base: str) -> dict:
    client = openai_client(base)
    tool = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
            "parameters": WEATHER_TOOL["function"]["parameters"]}
    items: list[Any] = [{"role": "user", "content": WEATHER_Q}]
    for rounds in range(1, MAX_ROUNDS + 1):
        r = client.responses.create(model="default", input=items, tools=[tool], max_output_tokens=64, temperature=0)
        calls = [o for o in r.output if o.type == "function_call"]
        if not calls:
            return result(r.status == "completed", f"answered after {rounds - 1} call(s): {short(r.output_text)}",
                          rounds)
        for call in calls:
            items += [call.model_dump(exclude_none=True), {"type": "function_call_output", "call_id": call.call_id,
                                                           "output": get_weather(**json.loads(call.arguments))}]
    return result(False, f"still calling after {MAX_ROUNDS} rounds", MAX_ROUNDS)


# ---- llm (Simon Willison's CLI) ----------------------------------------------------------------------------


def llm_cli(base: str, *args: str) -> subprocess.CompletedProcess:
    home = Path(tempfile.mkdtemp(prefix="llm-home-"))
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: roofline\n  model_name: default\n  api_base: \"{base}\"\n  supports_tools: true\n"
        "  can_stream: true\n")
    exe = Path(sys.executable).with_name("llm")
    env = {**os.environ, "LLM_USER_PATH": str(home)}
    return subprocess.run([str(exe), "-m", "roofline", "--key", "unused", "-o", "temperature", "0", *args],
                          capture_output=True, text=True, timeout=300, env=env)


def llm_chat(base: str) -> dict:
    r = llm_cli(base, "--no-stream", "-o", "max_tokens", "16", ASK)
    return result(r.returncode == 0 and bool(r.stdout.strip()), f"reply {short(r.stdout)}" if r.returncode == 0
                  else r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}", 1)


def llm_stream(base: str) -> dict:
    r = llm_cli(base, "-o", "max_tokens", "16", ASK)
    return result(r.returncode == 0 and bool(r.stdout.strip()), f"reply {short(r.stdout)}" if r.returncode == 0
                  else r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}", 1)


def llm_functions(base: str) -> dict:
    code = ('def get_weather(city: str) -> str:\n    "Current weather in a city."\n'
            '    return f"18 degrees and sunny in {city}"\n')
    r = llm_cli(base, "--functions", code, "--td", "--cl", str(MAX_ROUNDS), "-o", "max_tokens", "64", WEATHER_Q)
    out = r.stdout + r.stderr
    calls = out.count("Tool call: get_weather")
    if r.returncode != 0 or "Chain limit" in out:
        last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        return result(False, f"{calls} call(s), then: {last}", calls + 1)
    answer = [line for line in r.stdout.splitlines() if line.strip() and not line.startswith(("Tool call", "  "))]
    return result(calls >= 1 and bool(answer), f"{calls} call(s), then answered {short(answer[-1] if answer else '')}",
                  calls + 1)


# ---- litellm -------------------------------------------------------------------------------------------------


def litellm_kwargs(base: str) -> dict:
    return {"model": "openai/default", "api_base": base, "api_key": "unused", "temperature": 0}


def litellm_chat(base: str) -> dict:
    import litellm

    r = litellm.completion(messages=[{"role": "user", "content": ASK}], max_tokens=16, **litellm_kwargs(base))
    return result(bool(r.choices[0].message.content), f"reply {short(r.choices[0].message.content)}", 1)


def litellm_stream(base: str) -> dict:
    import litellm

    chunks = list(litellm.completion(messages=[{"role": "user", "content": ASK}], max_tokens=16, stream=True,
                                     **litellm_kwargs(base)))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return result(bool(text), f"{len(chunks)} chunks: {short(text)}", 1)


def litellm_tools_loop(base: str) -> dict:
    import litellm

    return chat_tools_loop(lambda messages: litellm.completion(messages=messages, tools=[WEATHER_TOOL], max_tokens=64,
                                                               **litellm_kwargs(base)))


# ---- langchain-openai ----------------------------------------------------------------------------------------


def langchain_model(base: str, **kw: Any) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model="default", base_url=base, api_key="unused", temperature=0, max_retries=0, **kw)


def langchain_chat(base: str) -> dict:
    r = langchain_model(base, max_tokens=16).invoke(ASK)
    return result(bool(r.content), f"reply {short(r.content)}", 1)


def langchain_stream(base: str) -> dict:
    chunks = list(langchain_model(base, max_tokens=16).stream(ASK))
    text = "".join(c.content for c in chunks)
    return result(bool(text), f"{len(chunks)} chunks: {short(text)}", 1)


def langchain_tools_loop(base: str) -> dict:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    weather = tool(get_weather)
    model = langchain_model(base, max_tokens=64).bind_tools([weather])
    messages: list[Any] = [HumanMessage(WEATHER_Q)]
    for rounds in range(1, MAX_ROUNDS + 1):
        ai = model.invoke(messages)
        if not ai.tool_calls:
            return result(True, f"answered after {rounds - 1} call(s): {short(ai.content)}", rounds)
        messages.append(ai)
        for call in ai.tool_calls:
            messages.append(ToolMessage(weather.invoke(call["args"]), tool_call_id=call["id"]))
    return result(False, f"still calling after {MAX_ROUNDS} rounds", MAX_ROUNDS)


def langchain_structured(base: str) -> dict:
    import pydantic

    class City(pydantic.BaseModel):
        city: str
        country: str

    r = langchain_model(base, max_tokens=48).with_structured_output(City, method="json_schema").invoke(ASK)
    return result(isinstance(r, City), f"parsed {r!r}", 1)


# ---- pydantic-ai ---------------------------------------------------------------------------------------------


def pydantic_ai_agent(base: str, **kw: Any) -> Any:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("default", provider=OpenAIProvider(base_url=base, api_key="unused"))
    return Agent(model, model_settings={"temperature": 0, "max_tokens": 64}, **kw)


def pydantic_ai_tool(base: str) -> dict:
    from pydantic_ai import UsageLimits

    agent = pydantic_ai_agent(base, tools=[get_weather])
    r = agent.run_sync(WEATHER_Q, usage_limits=UsageLimits(request_limit=MAX_ROUNDS))
    calls = sum(1 for m in r.all_messages() for p in getattr(m, "parts", []) if p.part_kind == "tool-call")
    return result(isinstance(r.output, str) and bool(r.output), f"{calls} call(s), then {short(r.output)}",
                  r.usage.requests)


def pydantic_ai_structured(base: str) -> dict:
    import pydantic
    from pydantic_ai import UsageLimits

    class City(pydantic.BaseModel):
        city: str
        country: str

    r = pydantic_ai_agent(base, output_type=City).run_sync(ASK, usage_limits=UsageLimits(request_limit=MAX_ROUNDS))
    return result(isinstance(r.output, City), f"parsed {r.output!r}", r.usage.requests)


# ---- instructor ----------------------------------------------------------------------------------------------


def instructor_mode(base: str, mode_name: str) -> dict:
    import instructor
    import pydantic

    class User(pydantic.BaseModel):
        name: str
        age: int

    client = instructor.from_openai(openai_client(base), mode=getattr(instructor.Mode, mode_name))
    user = client.chat.completions.create(model="default", response_model=User, max_retries=0, max_tokens=64,
                                          temperature=0, messages=[{"role": "user", "content":
                                                                    "Extract the user: Jason is 25 years old."}])
    return result(isinstance(user, User), f"parsed {user!r}", 1)


CASES = {
    "openai.chat": openai_chat,
    "openai.stream": openai_stream,
    "openai.tools_loop": openai_tools_loop,
    "openai.parse": openai_parse,
    "openai.responses_loop": openai_responses_loop,
    "llm.chat": llm_chat,
    "llm.stream": llm_stream,
    "llm.functions": llm_functions,
    "litellm.chat": litellm_chat,
    "litellm.stream": litellm_stream,
    "litellm.tools_loop": litellm_tools_loop,
    "langchain.chat": langchain_chat,
    "langchain.stream": langchain_stream,
    "langchain.tools_loop": langchain_tools_loop,
    "langchain.structured": langchain_structured,
    "pydantic_ai.tool_agent": pydantic_ai_tool,
    "pydantic_ai.output_type": pydantic_ai_structured,
    "instructor.json_schema": lambda base: instructor_mode(base, "JSON_SCHEMA"),
    "instructor.tools": lambda base: instructor_mode(base, "TOOLS"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", help="the server's /v1 URL, on a loopback address")
    ap.add_argument("--case", choices=list(CASES))
    ap.add_argument("--list", action="store_true", help="print the cases, one a line, and exit")
    args = ap.parse_args()
    if args.list:
        print("\n".join(CASES))
        return
    if args.case is None or args.base_url is None:
        ap.error("--base-url and --case are required")
    try:
        out = CASES[args.case](args.base_url)
    except Exception as e:  # noqa: BLE001 - a failing client is a row of the table, not a crash
        last = traceback.extract_tb(e.__traceback__)[-1]
        out = result(False, f"{type(e).__name__}: {e} ({Path(last.filename).name}:{last.lineno})")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
