"""Chat templates: Jinja rendering compatible with transformers' `apply_chat_template`.

Templates come from model files and are untrusted code: they run in jinja2's immutable sandbox with the globals
and filters transformers gives them (`raise_exception`, `strftime_now`, a JSON `tojson`, `namespace`, `dict`).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mlx_engine.api import RequestError

# Used when a model has no chat template: plain `role: content` lines, then "assistant:" for the reply.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Namespaces reject underscore names so a template cannot reach CPython internals through them.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


class _TemplateDict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' version: no HTML escaping (jinja's own filter escapes <, >, &, ')
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached by source text). Raises RequestError on a syntax error."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise RequestError(f"the model's chat template has a syntax error (line {e.lineno}): {e.message}") from None


def read_chat_template(value: str) -> str:
    """A chat template given in place of the model's own: its Jinja text, or the path of a file holding it (a
    `.jinja` file, or a tokenizer_config.json with a `chat_template` field). Checked now, so a mistake is a
    ModelLoadError naming it before any model loads."""
    from pathlib import Path

    from mlx_engine.api import ModelLoadError

    where, source = "the chat template given", value
    if "{{" not in value and "{%" not in value:  # not Jinja text: a file
        path = Path(value).expanduser()
        where = f"chat template {path}"
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{where}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
        if path.suffix == ".json":
            try:
                field = json.loads(source).get("chat_template")
            except (ValueError, AttributeError):
                field = None
            if not isinstance(field, str):
                raise ModelLoadError(f"{where}: a .json file needs a string 'chat_template' field (as in "
                                     "tokenizer_config.json)")
            source = field
    try:
        compile_template(source)
    except RequestError as e:
        detail = str(e).replace("the model's chat template", "it")
        raise ModelLoadError(f"{where}: {detail}") from None
    return source


def _plain(value: Any) -> Any:
    """Only JSON-like data reaches the template (anything else is an inert placeholder)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item):
        try:
            return _plain(item())
        except (TypeError, ValueError):
            pass
    return f"<{type(value).__name__}>"


def render_chat_template(
    source: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    special_tokens: dict[str, str] | None = None,
    **kwargs: Any,
) -> str:
    """Render `messages` as transformers does: keys whose value is None are dropped from each message, and
    `special_tokens` (bos_token, eos_token, ...) are variables that `kwargs` may override.
    Raises RequestError with the template's message when it fails or calls `raise_exception`."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise RequestError("messages must be a list of {'role': ..., 'content': ...} dicts")
    template = compile_template(source)
    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    variables = {**(special_tokens or {}), **kwargs}
    try:
        return template.render(
            messages=_plain(chat),
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **_plain(variables),
        )
    except jinja2.exceptions.TemplateError as e:  # raise_exception, undefined calls, sandbox violations
        raise RequestError(f"chat template error: {e.message or e}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as e:
        raise RequestError(f"chat template error: {type(e).__name__}: {e}") from None


# Plane 16's private-use characters stand in for a conversation's look-alikes of special tokens while the template
# renders: single characters, so `trim`, `split` and the like treat them as the text they replace.
_PRIVATE_USE = range(0x100000, 0x10FFFE)


def render_with_literals(
    source: str,
    messages: list[dict[str, Any]],
    literal: re.Pattern[str] | None,
    *,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    special_tokens: dict[str, str] | None = None,
    **kwargs: Any,
) -> tuple[str, list[tuple[int, int]]]:
    """`render_chat_template`, and the spans of the rendered text where `literal` matched inside the conversation's
    strings (messages, tools, documents): text from users and tools, which the tokenizer must not read as the special
    tokens it spells. Each match is replaced by a placeholder character before rendering and put back after, so the
    spans are exact whatever the template does around it."""
    found: dict[str, str] = {}  # matched text -> its placeholder
    data = (messages, tools, documents)
    if literal is not None and _any_match(literal, data):
        taken = set(source)
        _collect_chars(data, taken)
        free = (chr(c) for c in _PRIVATE_USE if chr(c) not in taken)

        def mark(m: re.Match[str]) -> str:
            if m.group(0) not in found:
                found[m.group(0)] = next(free)
            return found[m.group(0)]

        messages, tools, documents = _substitute(data, lambda s: literal.sub(mark, s))
    text = render_chat_template(source, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                documents=documents, special_tokens=special_tokens, **kwargs)
    if not found:
        return text, []
    restore = {p: t for t, p in found.items()}
    out: list[str] = []
    spans: list[tuple[int, int]] = []
    at = last = 0
    for m in re.finditer("|".join(map(re.escape, restore)), text):
        out.append(text[last:m.start()])
        at += m.start() - last
        original = restore[m.group(0)]
        out.append(original)
        spans.append((at, at + len(original)))
        at += len(original)
        last = m.end()
    out.append(text[last:])
    return "".join(out), spans


def _any_match(pattern: re.Pattern[str], value: Any) -> bool:
    if isinstance(value, str):
        return pattern.search(value) is not None
    if isinstance(value, dict):
        return any(_any_match(pattern, v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_any_match(pattern, v) for v in value)
    return False


def _collect_chars(value: Any, into: set[str]) -> None:
    if isinstance(value, str):
        into.update(c for c in value if ord(c) >= _PRIVATE_USE.start)
    elif isinstance(value, dict):
        for v in value.values():
            _collect_chars(v, into)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect_chars(v, into)


def _substitute(value: Any, fn: Any) -> Any:
    """`value` with `fn` applied to every string in it (dict keys excepted)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: _substitute(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, fn) for v in value]
    if isinstance(value, tuple):
        return tuple(_substitute(v, fn) for v in value)
    return value
