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


SIMPLE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"


def test_a_chat_template_given_at_load_replaces_the_models(tmp_path) -> None:
    """`Engine.load(chat_template=...)` (the CLI's --chat-template): as text, a .jinja file or a
    tokenizer_config.json, the conversation is rendered with it; a bad one is a ModelLoadError naming it, before
    the model loads."""
    from mlx_engine import Engine, GenerationRequest, ModelLoadError
    from tests.support.tiny_models import random_llama_folder, write_gguf_from_folder

    gguf = tmp_path / "tiny.gguf"
    write_gguf_from_folder(random_llama_folder(tmp_path / "hf", vocab=160), gguf, {}, default_type="F32")
    (tmp_path / "t.jinja").write_text(SIMPLE)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": SIMPLE, "eos_token": "x"}))
    chat = GenerationRequest(messages=[{"role": "user", "content": "hi"}])
    for given in (SIMPLE, str(tmp_path / "t.jinja"), str(tmp_path / "tokenizer_config.json")):
        with Engine.load(str(gguf), chat_template=given) as e:
            assert e.tokenizer.chat_template == SIMPLE
            assert e.prompt_ids(chat) == e.tokenizer.encode("<user>hi\n<a>", add_special_tokens=False)
    with Engine.load(str(gguf)) as e:
        assert e.prompt_ids(chat) != e.tokenizer.encode("<user>hi\n<a>", add_special_tokens=False)
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    (tmp_path / "other.json").write_text("{}")
    for given, words in ((str(tmp_path / "none.jinja"), "none.jinja: cannot read it"),
                         (str(tmp_path / "bad.jinja"), "bad.jinja: it has a syntax error (line 1)"),
                         ("{{ unclosed", "the chat template given: it has a syntax error"),
                         (str(tmp_path / "other.json"), "needs a string 'chat_template' field")):
        with pytest.raises(ModelLoadError) as err:
            Engine.load(str(gguf), chat_template=given)
        assert words in str(err.value)
    with pytest.raises(ModelLoadError, match="has no tokenizer, so a chat template cannot be used"):
        Engine.load(str(random_llama_folder(tmp_path / "bare")), chat_template=SIMPLE)
