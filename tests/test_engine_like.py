"""Every engine a front end may be handed, the real one and the scripted fakes its tests run against, has exactly
the surface `mlx_engine.api.EngineLike` lists, member by member (a fake that lacks a method, or takes other
arguments, fails here rather than in the one front-end test that happens to call it)."""

from __future__ import annotations

import pytest

from mlx_engine.api import EngineLike, ModelInfo
from tests.support.protocols import members, mismatches
from tests.support.tiny_models import GOLDEN


def test_the_protocol_lists_what_front_ends_use() -> None:
    assert set(members(EngineLike)) == {"info", "tokenizer", "generate", "kv_stats", "save_kv", "restore_kv",
                                        "decode_bytes_per_token", "close"}


def server_fake() -> object:
    from tests.support.server_fakes import FakeEngine

    return FakeEngine()


def tui_fake() -> object:
    from tests.support.tui_fake_engine import FakeEngine

    return FakeEngine()


@pytest.mark.parametrize("make", [server_fake, tui_fake],
                         ids=["tests.support.server_fakes", "tests.support.tui_fake_engine"])
def test_every_fake_engine_has_the_engine_surface(make) -> None:
    engine = make()
    assert mismatches(engine) == []
    assert isinstance(engine, EngineLike) and isinstance(engine.info, ModelInfo)


def test_the_real_engine_has_it() -> None:
    from mlx_engine import Engine

    with Engine.load(str(GOLDEN / "llama")) as engine:
        assert mismatches(engine) == []
        assert isinstance(engine, EngineLike) and isinstance(engine.info, ModelInfo)


def test_a_fake_short_of_a_method_or_an_argument_is_named() -> None:
    class Partial:
        info = None
        tokenizer = None

        def generate(self, request): ...

        def kv_stats(self): ...

        def save_kv(self, path): ...  # the request is missing

        def restore_kv(self, path, strict): ...  # an argument the protocol never gives

        def decode_bytes_per_token(self, context_tokens): ...

    assert mismatches(Partial()) == ["save_kv: takes (path), the protocol (path, request)",
                                     "restore_kv: needs more arguments than the protocol gives", "close: missing"]
