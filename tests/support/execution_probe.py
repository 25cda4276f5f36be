"""Runs one `roofline` command in this process and prints, as the last line of stdout, how each engine it loaded
ran its forwards (`Engine.diagnostics().execution()`, read before the engine closes or at the command's end):
`python -m tests.support.execution_probe generate -m MODEL ...`. A process of its own per command, since which threads
have run torch's work is the process's (tests/test_bench_vs_generate.py)."""

from __future__ import annotations

import json
import sys
from typing import Any

from mlx_engine import Engine


def main(argv: list[str]) -> int:
    engines: list[Engine] = []
    records: list[dict[str, Any]] = []
    load, close = Engine.load.__func__, Engine.close  # type: ignore[attr-defined]

    def recording_load(cls: type[Engine], *args: Any, **kwargs: Any) -> Engine:
        engine = load(cls, *args, **kwargs)
        engines.append(engine)
        return engine

    def recording_close(self: Engine) -> None:
        if self in engines:
            engines.remove(self)
            records.append(self.diagnostics().execution())
        close(self)

    Engine.load = classmethod(recording_load)  # type: ignore[method-assign, assignment]
    Engine.close = recording_close  # type: ignore[method-assign]
    from app.cli import main as roofline

    rc = roofline(argv)
    records += [e.diagnostics().execution() for e in engines]
    print(json.dumps({"rc": rc, "engines": records}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
