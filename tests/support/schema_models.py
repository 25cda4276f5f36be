"""The pydantic models the schema tests send: a nested model (pydantic writes `$defs` and a local `$ref`, as the
openai SDK's `pydantic_function_tool` and the Agents SDK send them) and a recursive one (`"$ref": "#/$defs/Node"`)."""

from __future__ import annotations

import pydantic


class Address(pydantic.BaseModel):
    street: str
    city: str


class Person(pydantic.BaseModel):
    name: str
    address: Address


class Node(pydantic.BaseModel):
    name: str
    children: list[Node]
