import os

import pytest

from tests.support.torch_support import SKIP_REASON

# .ci/run sets it to a file: the node ids of the tests skipped for want of torch, one a line, for its second run
TORCH_SKIPS = "ROOFLINE_TORCH_SKIPS"


@pytest.fixture(scope="session", autouse=True)
def _private_cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """What the engine keeps between runs (the speculative cost curve) goes to a folder of this test session,
    never to the user's cache; set before any fixture starts a server process, which inherits it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ROOFLINE_CACHE_DIR", str(tmp_path_factory.mktemp("roofline-cache")))
        # the torch CPU backend compiles its decode step at load by default where that step is not native (tens
        # of seconds on 2 cores); the tests that check the compiled step ask for it (compile=True)
        mp.setenv("ROOFLINE_TORCH_COMPILE", "0")
        yield


def _record_torch_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    path = os.environ.get(TORCH_SKIPS)
    if not path or not report.skipped:
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    if SKIP_REASON in reason:
        with open(path, "a", encoding="utf-8") as f:
            f.write(report.nodeid + "\n")


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _record_torch_skip(report)  # a module that needs torch throughout skips as it is collected


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _record_torch_skip(report)


@pytest.fixture(scope="module")
def engine():
    """The embedded model on MLX (what a fresh clone's default picks; the same where torch is installed), loaded once
    per test module that asks for `engine` and defines none of its own."""
    from mlx_engine import Engine

    with Engine.load(backend="mlx") as e:
        yield e


@pytest.fixture(scope="module")
def server(engine):
    """`roofline serve`'s app over `engine` on a free loopback port, for the module's tests."""
    from app.server import create_app
    from tests.support.server_fakes import LiveServer

    with LiveServer(create_app(engine), drain_s=5) as s:
        yield s


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory):
    """A cache dir of the module's own (ROOFLINE_CACHE_DIR), for tests of what the engine writes there."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("cache")
        mp.setenv("ROOFLINE_CACHE_DIR", str(path))
        yield path
