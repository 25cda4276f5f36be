"""`roofline generate` on the tiny thinking model (tests/support/think_models.py): the answer on stdout, the thinking on
stderr (or in --json's `reasoning`), --reasoning-effort and --reasoning-budget, and their mistakes as one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import assert_one_line_error
from tests.support.think_models import ANSWER, REASONING, think_model_folder


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(think_model_folder(tmp_path_factory.mktemp("think") / "tags"))


def generate(model: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "app.cli", "generate", "-m", model, "-p", "Hi?", *args],
                          capture_output=True, text=True, timeout=300, env=env)


def test_the_answer_on_stdout_the_thinking_on_stderr(model: str) -> None:
    r = generate(model)
    assert r.returncode == 0, r.stderr
    assert r.stdout == ANSWER + "\n"
    assert r.stderr.startswith(REASONING + "\n") and "reply 14 tok (9 reasoning)" in r.stderr
    r = generate(model, "--hide-reasoning")
    assert r.stdout == ANSWER + "\n" and REASONING not in r.stderr


@pytest.mark.parametrize("args, reasoning, tokens", [((), REASONING, 9), (("--reasoning-effort", "none"), "", 0),
                                                      (("--reasoning-budget", "3"), REASONING[:3], 4)])
def test_json_carries_the_reasoning(model: str, args: tuple[str, ...], reasoning: str, tokens: int) -> None:
    r = generate(model, "--json", *args)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["text"], out["reasoning"], out["usage"]["reasoning_tokens"]) == (ANSWER, reasoning, tokens)


def test_reasoning_mistakes_are_one_line(model: str, tmp_path: Path) -> None:
    assert_one_line_error(generate(model, "--reasoning-effort", "hgih"), "--reasoning-effort 'hgih'",
                          "did you mean high?")
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert_one_line_error(generate(model, "--chat-template", str(template), "--reasoning-budget", "2"),
                          "reasoning_budget=2", "does not reason")
