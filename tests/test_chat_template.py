"""Chat templates: transformers-compatible rendering in a sandbox, errors as RequestError."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from mlx_engine.api import RequestError
from mlx_engine.chat_template import FALLBACK_TEMPLATE, compile_template, render_chat_template

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}<|im_start|>system\nDefault system<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def render(source: str, messages=None, **kwargs) -> str:
    return render_chat_template(source, messages or [{"role": "user", "content": "hi"}], **kwargs)


def test_system_message_and_generation_prompt():
    user = [{"role": "user", "content": "hi"}]
    assert render(CHATML, user) == (
        "<|im_start|>system\nDefault system<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    system = [{"role": "system", "content": "Be terse."}, *user]
    assert render(CHATML, system, add_generation_prompt=False) == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    )


def test_raise_exception_is_a_request_error():
    source = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
    )
    assert render(source) == ""
    with pytest.raises(RequestError, match="Conversation roles must alternate"):
        render(source, [{"role": "assistant", "content": "x"}])


def test_template_errors_are_request_errors():
    with pytest.raises(RequestError, match="syntax error"):
        render("{% for m in messages %}")
    with pytest.raises(RequestError, match="chat template error"):
        render("{{ messages[0]['content'].nope() }}")
    with pytest.raises(RequestError, match="chat template error"):  # the sandbox is immutable
        render("{{ messages.append(1) }}")
    with pytest.raises(RequestError, match="underscore"):
        render("{% set ns = namespace(_secret=1) %}")
    with pytest.raises(RequestError, match="messages"):
        render_chat_template(CHATML, [["not", "a", "dict"]])


def test_tojson_like_transformers():
    messages = [{"role": "user", "content": "你好 <b>&'"}]
    assert render("{{ messages[0] | tojson }}", messages) == json.dumps(messages[0], ensure_ascii=False)
    assert render("{{ messages[0]['content'] | tojson(ensure_ascii=True) }}", messages) == json.dumps("你好 <b>&'")
    assert render("{{ {'a': [1, 2]} | tojson(indent=2) }}") == '{\n  "a": [\n    1,\n    2\n  ]\n}'
    assert render("{{ {'b': 1, 'a': 2} | tojson(separators=(',', ':'), sort_keys=true) }}") == '{"a":2,"b":1}'


def test_strftime_now_and_variables():
    year = datetime.now().strftime("%Y")
    assert render("{{ strftime_now('%Y') }}") == year
    source = "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}|{{ enable_thinking }}"
    tokens = {"bos_token": "<s>", "eos_token": "</s>"}
    assert render(source, special_tokens=tokens, enable_thinking=False) == "<s>hi</s>|False"
    # kwargs override the special tokens, as in transformers
    assert render("{{ bos_token }}", special_tokens=tokens, bos_token="[BOS]") == "[BOS]"


def test_tools_and_none_values():
    source = (
        "{% if tools is not none %}TOOLS {{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}{{ m['role'] }}{% if 'content' in m %}: {{ m['content'] }}{% endif %};{% endfor %}"
    )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": None}]
    assert render(source, messages) == "user: hi;assistant;"  # keys whose value is None are dropped
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert render(source, messages, tools=tools).startswith('TOOLS [{"type": "function"')


def test_loop_controls_and_trim_blocks():
    source = """{% for m in messages %}
  {% if loop.index > 2 %}{% break %}{% endif %}
  {% if m['role'] == 'system' %}{% continue %}{% endif %}
{{ m['content'] }}
{% endfor %}"""
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert render(source, messages) == "a\n"


def test_namespace_and_dict():
    source = "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}" \
             "{{ dict(a=1)['a'] }}"
    assert render(source, [{"role": "user", "content": "x"}] * 3) == "31"


def test_compiled_templates_are_cached():
    assert compile_template(CHATML) is compile_template(CHATML)


def test_fallback_template():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert render(FALLBACK_TEMPLATE, messages) == "user: hi\nassistant: hello\nassistant:"
