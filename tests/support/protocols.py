"""A protocol's surface held against an object, member by member: what the engine-like tests and the embedding
engine's test check a fake or a real engine with."""

from __future__ import annotations

import inspect
from typing import Any

from mlx_engine.api import EngineLike


def members(protocol: type) -> dict[str, Any]:
    """The protocol's members: its annotated attributes (None) and its methods (the function)."""
    out: dict[str, Any] = {name: None for name in protocol.__annotations__}
    out.update({name: fn for name, fn in vars(protocol).items() if inspect.isfunction(fn) and not name.startswith("_")})
    return out


def mismatches(engine: object, protocol: type = EngineLike) -> list[str]:
    """What `engine` lacks of `protocol`, or takes differently: one line per member."""
    problems = []
    for name, fn in members(protocol).items():
        if not hasattr(engine, name):
            problems.append(f"{name}: missing")
            continue
        if fn is None:
            continue
        impl = getattr(engine, name)
        if not callable(impl):
            problems.append(f"{name}: not a method")
            continue
        want = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
        got = list(inspect.signature(impl).parameters.values())
        if [p.name for p in got[:len(want)]] != [p.name for p in want]:
            problems.append(f"{name}: takes ({', '.join(p.name for p in got)}), the protocol "
                            f"({', '.join(p.name for p in want)})")
        elif any(p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                 for p in got[len(want):]):
            problems.append(f"{name}: needs more arguments than the protocol gives")
    return problems
