"""The pydantic models the schema tests send: a nested model (pydantic writes `$defs` and a local `$ref`, as the
openai SDK's `pydantic_function_tool` and the Agents SDK send them) and a recursive one (`"$ref": "#/$defs/Node"`)."""

from __future__ import annotations

import pydantic

from mlx_engine.structured import bytes_tokenizer


class Address(pydantic.BaseModel):
    street: str
    city: str


class Person(pydantic.BaseModel):
    name: str
    address: Address


class Node(pydantic.BaseModel):
    name: str
    children: list[Node]


# What pydantic 2 emits for Person: the nested model in $defs, referred to from the root.
PERSON = {"$defs": {"Address": {"properties": {"street": {"title": "Street", "type": "string"},
                                               "city": {"title": "City", "type": "string"}},
                                "required": ["street", "city"], "title": "Address", "type": "object"}},
          "properties": {"name": {"title": "Name", "type": "string"}, "address": {"$ref": "#/$defs/Address"}},
          "required": ["name", "address"], "title": "Person", "type": "object"}


BYTES = bytes_tokenizer()
