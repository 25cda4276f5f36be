"""JSON Schemas in tools and response formats, without a model: pydantic's nested models (`$defs` and local
`$ref`s) and recursive schemas keep their meaning inside the tool-call schema; `allOf` stays satisfiable once
objects are closed; a schema the grammar cannot hold a reply to is a 400 naming its field, in one short line, on
every endpoint and in the CLI."""

from __future__ import annotations

import json
from typing import Any

import pytest
from llguidance import LLMatcher

from app.server.errors import APIError
from app.server.protocol import parse_job
from app.server.responses_api import parse_responses
from app.toolcalls.schemas import closed, rebased, schema_error
from mlx_engine.api import ResponseFormat
from mlx_engine.structured import grammar
from tests.support.cli import assert_one_line_error, roofline
from tests.support.schema_models import BYTES, PERSON, Node, Person

NAMES = {"fake"}


def job(body: dict[str, Any]):
    return parse_job({"model": "fake", "messages": [{"role": "user", "content": "hi"}], **body}, "chat", NAMES,
                     "fake", 4096, 1000)


def chat_error(body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as e:
        job(body)
    return e.value


def responses_error(body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as e:
        parse_responses({"model": "fake", "input": "hi", **body}, NAMES, "fake", 4096, 1000)
    return e.value


def accepts(schema: dict[str, Any], text: str) -> bool:
    """Whether the grammar the engine builds from `schema` takes `text` whole."""
    m = LLMatcher(BYTES, grammar(ResponseFormat("json_schema", schema=schema)), log_level=0)
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(list(text.encode())) and m.is_accepting()


def tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_the_schema_written_here_is_pydantic_s() -> None:
    assert Person.model_json_schema() == PERSON


def test_a_nested_model_tool_keeps_its_refs_pointing_into_its_own_parameters() -> None:
    """Inline, `#/$defs/Address` would resolve against the tool-call schema's root ("Pointer '/$defs/Address' does
    not exist"): the parameters go under the root's `$defs`, named after the function, their refs rewritten."""
    j = job({"tools": [tool("save_person", PERSON), tool("tree", Node.model_json_schema())]})
    schema = j.sampling["response_format"].schema
    assert schema_error(schema) is None
    assert schema["$defs"]["save_person"]["properties"]["address"] == {"$ref": "#/$defs/save_person/$defs/Address"}
    assert schema["$defs"]["tree"]["$ref"] == "#/$defs/tree/$defs/Node"
    call = {"tool_calls": [{"name": "save_person", "arguments": {"name": "Bob", "address": {
        "street": "1 Main St", "city": "Springfield"}}}]}
    assert accepts(schema, json.dumps(call))
    call["tool_calls"][0]["arguments"]["address"] = {"street": "1 Main St"}  # city is required
    assert not accepts(schema, json.dumps(call))
    call["tool_calls"][0]["arguments"]["address"] = {"street": "x", "city": "y", "zip": "1"}  # closed
    assert not accepts(schema, json.dumps(call))
    tree = {"name": "a", "children": [{"name": "b", "children": [{"name": "c", "children": []}]}]}
    assert accepts(schema, json.dumps({"tool_calls": [{"name": "tree", "arguments": tree}]}))
    tree["children"][0]["children"][0]["children"] = [{"name": "d"}]  # children required at every depth
    assert not accepts(schema, json.dumps({"tool_calls": [{"name": "tree", "arguments": tree}]}))
    assert accepts(schema, '{"response": "hi"}')
    plain = job({"tools": [tool("add", {"type": "object", "properties": {"a": {"type": "number"}}})]})
    assert "$defs" not in plain.sampling["response_format"].schema  # no refs: left inline


def test_a_root_reference_recurses_within_the_function() -> None:
    node = {"type": "object", "required": ["v", "kids"],
            "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}}}
    schema = job({"tools": [tool("walk", node)], "tool_choice": "required"}).sampling["response_format"].schema
    assert schema["$defs"]["walk"]["properties"]["kids"]["items"] == {"$ref": "#/$defs/walk"}
    args = {"v": 1, "kids": [{"v": 2, "kids": []}]}
    assert accepts(schema, json.dumps({"tool_calls": [{"name": "walk", "arguments": args}]}))
    inner = {"tool_calls": [{"name": "walk", "arguments": {"v": 2, "kids": []}}]}
    assert not accepts(schema, json.dumps({"tool_calls": [{"name": "walk", "arguments": {"v": 1, "kids": [inner]}}]}))
    # "#" is the function's parameters, not the reply's root: inline, `inner` was a valid kid


def test_rebased_rewrites_local_refs_only() -> None:
    schema = {"$id": "https://example.com/p", "$schema": "https://json-schema.org/draft/2020-12/schema",
              "properties": {"a": {"$ref": "#/definitions/A"}, "b": {"$ref": "#"}, "c": {"const": {"$ref": "#"}},
                             "d": {"$ref": "#anchor"}, "e": {"enum": [{"$ref": "#/x"}]}}}
    assert rebased(schema, "#/$defs/f") == {"properties": {
        "a": {"$ref": "#/$defs/f/definitions/A"}, "b": {"$ref": "#/$defs/f"}, "c": {"const": {"$ref": "#"}},
        "d": {"$ref": "#anchor"}, "e": {"enum": [{"$ref": "#/x"}]}}}


def test_closed_leaves_objects_combined_by_all_of_open() -> None:
    """Closing each branch (or the object beside them) would refuse the other branches' properties: the schema
    could then never be met."""
    base = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    extra = {"type": "object", "properties": {"b": {"type": "object", "properties": {"x": {"type": "string"}}}},
             "required": ["b"]}
    schema = closed({"$defs": {"Base": base}, "allOf": [{"$ref": "#/$defs/Base"}, extra]})
    assert "additionalProperties" not in schema["$defs"]["Base"] and "additionalProperties" not in schema["allOf"][1]
    assert schema["allOf"][1]["properties"]["b"]["additionalProperties"] is False  # a property's object is closed
    assert schema_error(schema) is None and accepts(schema, '{"a": "1", "b": {"x": "2"}}')
    beside = closed({"type": "object", "properties": {"a": {"type": "string"}},
                     "allOf": [{"properties": {"b": {"type": "string"}}, "required": ["b"]}]})
    assert schema_error(beside) is None and accepts(beside, '{"a": "1", "b": "2"}')
    # a lone allOf around a $ref (older pydantic, for a field with a description) is only a wrapper
    wrapped = closed({"$defs": {"A": base}, "type": "object", "properties": {"x": {"allOf": [{"$ref": "#/$defs/A"}],
                                                                                  "description": "d"}}})
    assert wrapped["$defs"]["A"]["additionalProperties"] is False
    one_of = closed({"oneOf": [{"type": "object", "properties": {"a": {"type": "string"}}},
                               {"type": "object", "properties": {"b": {"type": "integer"}}}]})
    assert schema_error(one_of) is None and accepts(one_of, '{"b": 1}')  # read as anyOf, as llama.cpp does


UNUSABLE = [({"$ref": "#"}, "admits no text"),
            ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "'/$defs/missing' does not exist"),
            ({"type": "colour"}, "Invalid type: colour"),
            ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
            ({"type": "array", "uniqueItems": True}, "uniqueItems"),
            ({"type": "object", "properties": {"x": {"$ref": "https://example.com/x.json"}}}, "example.com")]


@pytest.mark.parametrize(("schema", "reason"), UNUSABLE)
def test_an_unusable_schema_is_a_short_400_naming_its_field(schema: dict[str, Any], reason: str) -> None:
    cases = [(chat_error({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
              "response_format.json_schema.schema"),
             (chat_error({"tools": [tool("ok", {"type": "object"}), tool("bad", schema)]}),
              "tools[1].function.parameters"),
             (chat_error({"guided_json": schema}), "guided_json"),
             (responses_error({"text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}),
              "text.format.schema"),
             (responses_error({"tools": [{"type": "function", "name": "bad", "parameters": schema}]}),
              "tools[0].parameters")]
    for e, param in cases:
        assert (e.status, e.param, e.code) == (400, param, "invalid_schema"), e.message
        assert e.message.startswith(f"'{param}' is not a JSON Schema") and reason in e.message, e.message
        assert len(e.message) < 300 and "\n" not in e.message and "<state>" not in e.message


def test_the_cli_refuses_a_schema_that_admits_nothing_in_one_line(tmp_path) -> None:
    (tmp_path / "self.json").write_text('{"$ref": "#"}')
    assert_one_line_error(roofline("generate", "-p", "x", "--json-schema", str(tmp_path / "self.json")),
                          "the JSON Schema cannot be used: it admits no text")
