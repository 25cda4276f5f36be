"""Nested and recursive pydantic models as the openai client sends them (tools, `parse`, `pydantic_function_tool`),
against a live server on the embedded model: the replies validate; a schema that admits nothing is a short 400."""

from __future__ import annotations

import openai
import pytest
from mlx_engine import Engine

from app.server import create_app
from tests.support.server_fakes import LiveServer
from tests.support.schema_models import Address, Node, Person

BOB = [{"role": "user", "content": "Bob lives at 1 Main St, Springfield. Save him."}]




@pytest.fixture(scope="module")
def client():
    with LiveServer(create_app(Engine.load()), drain_s=5) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_nested_model_tool_named_in_tool_choice_gets_a_nested_call(client) -> None:
    """pydantic's `$defs` + `"$ref": "#/$defs/Address"`, as the Agents SDK and `pydantic_function_tool` send it: was
    a 400 "Pointer '/$defs/Address' does not exist" blaming response_format."""
    save = {"type": "function", "function": {"name": "save_person", "description": "Save a person",
                                             "parameters": Person.model_json_schema()}}
    r = client.chat.completions.create(model="default", messages=BOB, tools=[save], max_tokens=80, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "save_person"}})
    [call] = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "save_person"
    assert Person.model_validate_json(call.function.arguments) == Person(
        name="Bob", address=Address(street="1 Main St", city="Springfield"))

    r = client.chat.completions.parse(model="default", messages=BOB, tools=[openai.pydantic_function_tool(Person)],
                                      tool_choice={"type": "function", "function": {"name": "Person"}},
                                      max_tokens=80, temperature=0)
    parsed = r.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, Person) and isinstance(parsed.address, Address) and parsed.name == "Bob"

    r = client.chat.completions.parse(model="default", messages=BOB, response_format=Person, max_tokens=80,
                                      temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, Person) and r.choices[0].message.parsed.address.city


def test_a_recursive_model_tool(client) -> None:
    """children: list[Node] refers back to Node: the schema compiles and the call validates (greedy, the 135M model
    nests forever for most asks; this one it answers with a leaf)."""
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Make a tree: root has no children."}],
        tools=[openai.pydantic_function_tool(Node, name="make_tree")], max_tokens=120, temperature=0,
        tool_choice={"type": "function", "function": {"name": "make_tree"}})
    [call] = r.choices[0].message.tool_calls
    node = Node.model_validate_json(call.function.arguments)
    assert r.choices[0].finish_reason == "tool_calls" and node.children == []


def test_a_schema_that_admits_nothing_is_a_short_400(client) -> None:
    """`{"$ref": "#"}` compiles but admits no value: it was a 500 holding the grammar engine's state."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=BOB, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}})
    assert e.value.param == "response_format.json_schema.schema" and len(e.value.message) < 300
    assert "admits no text" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=BOB, max_tokens=5, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}])
    assert e.value.param == "tools[0].function.parameters" and len(e.value.message) < 300
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="default", input="hi", max_output_tokens=5, text={"format": {
            "type": "json_schema", "name": "x", "schema": {"$ref": "#"}}})
    assert e.value.param == "text.format.schema" and len(e.value.message) < 300
