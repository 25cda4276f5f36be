"""An agent's loop as the plain openai client runs it, on the embedded model at temperature 0: two tools offered
under "auto", each call answered with its result, until the model replies in text. The loop ends, within a few
steps, without the same call twice (docs/server.md, "Agent loops end")."""

from __future__ import annotations

import json

import openai
import pytest
from mlx_engine import Engine

from app.server import create_app
from tests.support.server_fakes import LiveServer

WEATHER = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current temperature in a city, in celsius",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "to_fahrenheit", "description": "Convert celsius to fahrenheit",
                                      "parameters": {"type": "object", "properties": {"celsius": {"type": "number"}},
                                                     "required": ["celsius"]}}}]
FLIGHTS = [
    {"type": "function", "function": {"name": "search_flights", "description": "Find flights between two cities",
                                      "parameters": {"type": "object", "required": ["origin", "destination"],
                                                     "properties": {"origin": {"type": "string"},
                                                                    "destination": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "book_flight", "description": "Book a flight by its id",
                                      "parameters": {"type": "object", "properties": {"flight_id": {"type": "string"}},
                                                     "required": ["flight_id"]}}}]
RESULTS = {"get_weather": lambda a: "18", "to_fahrenheit": lambda a: str(a["celsius"] * 9 / 5 + 32),
           "search_flights": lambda a: json.dumps([{"id": "AF123", "price": 120}]),
           "book_flight": lambda a: json.dumps({"booked": a["flight_id"], "status": "confirmed"})}
MAX_STEPS = 4


@pytest.fixture(scope="module")
def client():
    with LiveServer(create_app(Engine.load()), drain_s=5) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize(("ask", "tools"), [("What's the weather in Paris, in fahrenheit?", WEATHER),
                                            ("Search flights from NYC to LA.", FLIGHTS)])
def test_a_two_tool_agent_loop_ends_with_a_text_answer(client, ask: str, tools: list) -> None:
    messages: list = [{"role": "user", "content": ask}]
    calls: list[tuple[str, str]] = []
    for _ in range(MAX_STEPS):
        r = client.chat.completions.create(model="default", messages=messages, tools=tools, temperature=0,
                                           max_tokens=80)
        message = r.choices[0].message
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            assert (call.function.name, call.function.arguments) not in calls  # never the same call again
            calls.append((call.function.name, call.function.arguments))
            result = RESULTS[call.function.name](json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    else:
        pytest.fail(f"no text answer after {MAX_STEPS} steps: {calls}")
    assert calls and r.choices[0].finish_reason == "stop" and message.content
    assert not message.content.lstrip().startswith("{")  # the answer, not JSON
