"""JSON Schemas as the server passes them to the engine's grammar: objects closed where they do not say (`closed`),
a schema placed inside a bigger one with its local references still pointing into itself (`rebased`), and why a
schema cannot hold a reply (`schema_error`, llguidance's reason in one line)."""

from __future__ import annotations

from typing import Any

from mlx_engine.api import ResponseFormat

# keywords whose values are data, not schemas: a {"$ref": ...} inside them is a value to generate
_DATA = frozenset({"const", "enum", "default", "examples"})


def closed(schema: Any, require_all: bool = False) -> Any:
    """The schema with `additionalProperties: false` on every object that does not say, as llama.cpp's and xgrammar's
    (vLLM's) schema converters read an unspecified one: otherwise a small model pads a reply with properties the
    schema never declared, until max_tokens. `require_all`: every property required too (OpenAI's `strict: true`,
    whose replies always carry every key).

    Objects combined by `allOf` stay open at their own level (their properties' schemas are closed): closing one
    branch, the object beside the `allOf` or a `$defs` entry that is such a branch would refuse the others'
    properties (llguidance reads `additionalProperties` as JSON Schema does, per object). The request's own schema
    is not changed."""
    return _closed(schema, require_all, _all_of_refs(schema), stay_open=False)


def _closed(schema: Any, require_all: bool, open_refs: set[str], stay_open: bool) -> Any:
    if isinstance(schema, list):
        return [_closed(s, require_all, open_refs, False) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v, require_all, open_refs, False) if k in ("items", "anyOf", "oneOf", "prefixItems") else v
           for k, v in schema.items()}
    all_of = schema.get("allOf")
    if isinstance(all_of, list):
        out["allOf"] = [_closed(s, require_all, open_refs, _combined(schema)) for s in all_of]
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = _closed(schema["additionalProperties"], require_all, open_refs, False)
    if isinstance(schema.get("properties"), dict):
        out["properties"] = {k: _closed(v, require_all, open_refs, False) for k, v in schema["properties"].items()}
        if require_all:
            out["required"] = list(schema["properties"])
    for key in ("$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            out[key] = {k: _closed(v, require_all, open_refs, f"#/{key}/{k}" in open_refs)
                        for k, v in schema[key].items()}
    kind = schema.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in schema
    if is_object and not stay_open and "allOf" not in schema and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _combined(schema: dict[str, Any]) -> bool:
    """Whether the schema's `allOf` combines objects: several branches, or branches beside its own properties (a
    single branch alone is only a wrapper, as older pydantic's around a `$ref` with a description)."""
    branches = schema.get("allOf")
    return isinstance(branches, list) and (len(branches) > 1 or (len(branches) == 1 and "properties" in schema))


def _all_of_refs(schema: Any) -> set[str]:
    """The local references that are one of several `allOf` branches, anywhere in the schema."""
    found: set[str] = set()

    def walk(s: Any) -> None:
        if isinstance(s, list):
            for x in s:
                walk(x)
        elif isinstance(s, dict):
            if _combined(s):
                found.update(b["$ref"] for b in s["allOf"] if isinstance(b, dict) and isinstance(b.get("$ref"), str))
            for k, v in s.items():
                if k not in _DATA:
                    walk(v)

    walk(schema)
    return found


def has_local_refs(schema: Any) -> bool:
    """Whether the schema refers into itself (`$ref` "#", "#/...", "#anchor")."""
    if isinstance(schema, list):
        return any(has_local_refs(s) for s in schema)
    if not isinstance(schema, dict):
        return False
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        return True
    return any(has_local_refs(v) for k, v in schema.items() if k not in _DATA)


def rebased(schema: Any, base: str) -> Any:
    """The schema to be placed at `base` (a JSON Pointer fragment, "#/$defs/name") in a bigger document: each local
    `$ref` "#..." becomes `base` + its pointer, so it still points into this schema and not at the document's root
    ("#" itself, for recursion, becomes `base`). `$id` and `$schema` are dropped from its top: an `$id` would make
    the rewritten pointers resolve against the schema again. Anchors ("#name") are left as they are."""
    def walk(s: Any) -> Any:
        if isinstance(s, list):
            return [walk(x) for x in s]
        if not isinstance(s, dict):
            return s
        out = {k: (v if k in _DATA else walk(v)) for k, v in s.items()}
        ref = s.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            out["$ref"] = base + ref[1:]
        return out

    out = walk(schema)
    if isinstance(out, dict):
        out = {k: v for k, v in out.items() if k not in ("$id", "$schema")}
    return out


def schema_error(schema: dict[str, Any]) -> str | None:
    """Why the JSON Schema cannot hold a reply (llguidance's reason, one line, or that it admits no value), or None
    when it can."""
    from mlx_engine.structured import format_error

    return format_error(ResponseFormat("json_schema", schema=schema))
