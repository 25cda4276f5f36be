import pytest


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
