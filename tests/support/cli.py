"""The CLI as a user runs it, in a subprocess, and the one clear stderr line a mistake must give."""

from __future__ import annotations

import subprocess
import sys


def roofline(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("roofline: error: "), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    assert "Traceback" not in r.stderr


def one_line_error(r: subprocess.CompletedProcess, after_progress: bool = False) -> str:
    """The one stderr line of a failure (`after_progress`: it may follow a pull's progress lines)."""
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    if after_progress:
        assert all(line.startswith(("pulling ", "pulled ")) for line in lines[:-1]), r.stderr
        lines = lines[-1:]
    assert len(lines) == 1 and lines[0].startswith("roofline: error: "), r.stderr
    return lines[0]
