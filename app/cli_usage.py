"""argparse's usage errors as one line a person reads at a glance: what was wrong, a "did you mean" for a mistyped
command, choice or option, and where the help is."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

EXIT_USAGE = 2


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse with a one-line error instead of the usage: what was wrong, a "did you mean" for a mistyped
    command, choice or option, and where the help is (subcommands' parsers are this class too)."""

    def error(self, message: str) -> NoReturn:
        print(f"roofline: error: {_usage_message(self, message)}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _did_you_mean(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _usage_message(parser: argparse.ArgumentParser, message: str) -> str:
    """argparse's `message` as one line a person reads at a glance."""
    help_hint = f"`{parser.prog} --help`"
    m = re.fullmatch(r"argument (\S+?): invalid choice: '(.*)' \(choose from (.*)\)", message, re.S)
    if m:
        name, value = m.group(1), m.group(2)
        choices = re.findall(r"'([^']*)'", m.group(3)) or [c.strip() for c in m.group(3).split(",")]
        if name == "COMMAND":
            return f"unknown command {value!r}{_did_you_mean(value, choices)}; {help_hint} lists the commands"
        return f"{name} {value!r}: expected one of {', '.join(choices)}{_did_you_mean(value, choices)}"
    m = re.fullmatch(r"argument (\S+?): invalid (int|float) value: '(.*)'", message, re.S)
    if m:
        kind = "an integer" if m.group(2) == "int" else "a number"
        return f"{m.group(1).split('/')[0]} {m.group(3)!r}: expected {kind} ({help_hint})"
    m = re.fullmatch(r"unrecognized arguments: (.*)", message, re.S)
    if m:
        first = m.group(1).split()[0]
        if first.startswith("-"):
            options = {o for a in _all_actions(parser) for o in a.option_strings}
            return f"unknown option {first}{_did_you_mean(first.split('=')[0], sorted(options))} ({help_hint})"
        return f"unexpected argument {first!r} ({help_hint})"
    m = re.fullmatch(r"the following arguments are required: (.*)", message, re.S)
    if m:
        return f"{parser.prog} needs {m.group(1)} ({help_hint})"
    return f"{message} ({help_hint})"


def _all_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's actions and its subcommands', for suggesting an option: argparse reports an unknown option
    from the top parser, whichever command it was given to."""
    out = list(parser._actions)
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                out += _all_actions(sub)
    return out
