"""OpenAI request bodies -> a validated `Job`: every field type- and range-checked, errors naming the field.

OpenAI's semantics where they exist (defaults, ranges, `n`, `stop`, `logit_bias` with string keys); vLLM's
names for the extensions (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`); ours for speculative
decoding (`speculative`: "auto", "prompt-lookup", "self", "draft" or "off"; `num_draft_tokens`). Unknown
fields are ignored, as vLLM does; fields that would change the answer and are not supported (`suffix`,
best_of > 1, legacy `functions`) are refused rather than silently dropped. `response_format` (JSON mode, a JSON
Schema, checked in `schemas.py`) and chat `tools` become a grammar the reply is held to (`tools.py`, in the model's
tool-call format: `tool_formats.py`; the engine's `structured.py`). Chat takes vLLM's `chat_template_kwargs` (template
variables: {"enable_thinking": false}) and OpenAI's `reasoning_effort`, which the model's reasoning family maps onto
its template (`mlx_engine.reasoning.template_kwargs`).

`n` replies per prompt, and on /v1/completions up to MAX_CHOICES prompts in one request (an array of strings or
of token-id arrays): choice `index` = prompt * n + reply, at most MAX_CHOICES in all. With a `seed`, reply j
samples with seed + j, so the n replies differ and each is reproducible. /v1/completions also takes `echo` (the
prompt before the reply, with its tokens' log-probabilities when `logprobs` is set: what
lm-evaluation-harness scores multiple-choice tasks with).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from mlx_engine.api import MAX_DRAFT_TOKENS, MAX_LOGPROBS, REASONING_EFFORTS, SPECULATIVE_MODES, ResponseFormat
from mlx_engine.reasoning import RESERVED_TEMPLATE_VARIABLES

from app.server.fields import Fields, checked_text, kind_of, or_default, short
from app.server.errors import APIError, invalid
from app.toolcalls.schemas import closed, schema_error
from app.toolcalls.tool_formats import JSON, ToolFormat
from app.server.tool_request import history_calls, parse_tools
from app.toolcalls.tools import Tools

MAX_STOP = 4
MAX_CHOICES = 64  # prompts x n in one request; each choice is one engine request
SPECULATIVE_OFF = "off"
ROLES = ("system", "user", "assistant", "tool", "developer")

Endpoint = Literal["chat", "completion"]


def model_slug(name: str) -> str:
    """A stable model id from the model's display name: 'SmolLM2-135M (Q4_1 GGUF)' -> 'smollm2-135m-q4_1-gguf'."""
    slug = re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-.")
    return slug or "model"


@dataclass(frozen=True)
class Prompt:
    """One completion prompt: its text, or token ids."""

    text: str | None = None
    token_ids: list[int] | None = None


@dataclass
class Job:
    """One validated completion request, ready to tokenize and submit."""

    endpoint: Endpoint
    model: str
    messages: list[dict[str, Any]] | None = None
    prompts: list[Prompt] = field(default_factory=list)  # completions: n choices each
    n: int = 1  # replies per prompt
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams kwargs, without max_tokens
    max_tokens: int | None = None  # None: the rest of the context
    max_tokens_param: str = "max_tokens"
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False  # completions: the prompt comes back before the reply
    tools: Tools | None = None  # chat: functions offered (the reply is held to the tool-call format's grammar)
    tool_format: ToolFormat = JSON  # the model's way of calling tools (tool_formats.py): earlier calls, replies
    tool_variables: dict[str, Any] = field(default_factory=dict)  # the template's variables for the tools
    format_param: str = "response_format"  # the field the reply's grammar came from, for the engine's errors
    chat_template_kwargs: dict[str, Any] | None = None  # chat: the request's own template variables
    reasoning_effort: str | None = None  # chat: one of REASONING_EFFORTS
    prompt_param: str = "messages"  # what errors call a chat's prompt (Ollama's generate: "prompt")


# ---- the body ------------------------------------------------------------------------------------------


# ---- the fields ----------------------------------------------------------------------------------------


def parse_job(body: dict[str, Any], endpoint: Endpoint, model_names: set[str], served_id: str,
              context_length: int, vocab_size: int, tool_format: ToolFormat = JSON) -> Job:
    """Validates an OpenAI body for `endpoint` ("chat" or "completion"); tools and earlier calls take the model's
    `tool_format`. Raises APIError (4xx)."""
    f = Fields(body)
    if "model" not in body or body["model"] is None:
        raise invalid("you must provide a model parameter ('model': the id /v1/models lists, or 'default')",
                      "model", "missing_required_parameter")
    job = Job(endpoint=endpoint, model=check_model(f, model_names, served_id), tool_format=tool_format)

    if endpoint == "chat":
        job.messages = read_messages(body, tool_format)
    else:
        job.prompts = _prompts(body, vocab_size)

    job.n = or_default(f.integer("n", 1, MAX_CHOICES), 1)
    prompts = len(job.prompts) if endpoint == "completion" else 1
    if prompts * job.n > MAX_CHOICES:
        raise invalid(f"{prompts} prompts x n={job.n} is {prompts * job.n} choices; at most {MAX_CHOICES} per "
                      "request (send the rest as further requests)", "n", "too_many_choices")
    if endpoint == "completion":
        best_of = f.integer("best_of", 1)
        if best_of is not None and best_of != 1:
            raise invalid(f"best_of={best_of} is not supported (best_of must be 1)", "best_of", "unsupported_value")
        job.echo = bool(f.boolean("echo"))
        if f.string("suffix"):
            raise invalid("suffix is not supported (no fill-in-the-middle)", "suffix", "unsupported_value")

    for name in ("max_completion_tokens", "max_tokens"):  # the newer name wins when both are sent
        if f.get(name) is not None:
            if job.echo and f.get(name) == 0:  # legacy scoring: the echoed prompt and its logprobs, no reply
                job.max_tokens = 0
            else:
                job.max_tokens = f.integer(name, 1)
            job.max_tokens_param = name
            break
    if job.max_tokens is not None and job.max_tokens >= context_length:
        raise invalid(f"'{job.max_tokens_param}' is {job.max_tokens} but the model's context is {context_length} "
                      "tokens, prompt included", job.max_tokens_param, "context_length_exceeded")

    s: dict[str, Any] = {}
    s["temperature"] = or_default(f.number("temperature", 0, 2), 1.0)
    s["top_p"] = or_default(f.number("top_p", 0, 1, lo_open=True), 1.0)
    s["presence_penalty"] = or_default(f.number("presence_penalty", -2, 2), 0.0)
    s["frequency_penalty"] = or_default(f.number("frequency_penalty", -2, 2), 0.0)
    s["top_k"] = or_default(f.integer("top_k", -1), 0)
    if s["top_k"] == -1:  # vLLM's "off"
        s["top_k"] = 0
    s["min_p"] = or_default(f.number("min_p", 0, 1), 0.0)
    if s["min_p"] >= 1:
        raise invalid("'min_p' must be in [0, 1), got 1", "min_p")
    s["repetition_penalty"] = or_default(f.number("repetition_penalty", 0, 2**31, lo_open=True), 1.0)
    seed = f.integer("seed")
    if seed is not None:
        s["seed"] = seed
    s["ignore_eos"] = bool(f.boolean("ignore_eos"))
    _speculative(f, s)
    s["stop"] = _stop(f)
    s["logit_bias"] = _logit_bias(f, vocab_size)

    if endpoint == "chat":
        job.logprobs = bool(f.boolean("logprobs"))
        top = f.integer("top_logprobs", 0, MAX_LOGPROBS)
        if top is not None and top > 0 and not job.logprobs:
            raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        job.top_logprobs = top or 0
    else:
        top = f.integer("logprobs", 0, MAX_LOGPROBS)
        job.logprobs = top is not None
        job.top_logprobs = top or 0
    if job.logprobs:
        s["logprobs"] = job.top_logprobs

    _response_format(f, s)
    _guided(f, s, job)
    _tools(body, job, s)
    _reasoning(f, job)

    job.stream = bool(f.boolean("stream"))
    opts = f.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise f.wrong("stream_options", "an object")
        if not job.stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
        usage = opts.get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            raise invalid(f"'stream_options.include_usage' must be a boolean, got {kind_of(usage)}",
                          "stream_options.include_usage")
        job.include_usage = bool(usage)
    f.string("user")  # accepted and ignored, but it must be a string
    job.sampling = s
    return job


def check_model(f: Fields, model_names: set[str], served_id: str) -> str:
    model = f.string("model")
    if model is not None and model not in model_names:
        raise APIError(404, f"The model '{model}' does not exist: this server serves '{served_id}' "
                       "(also reachable as 'default')", "model", "model_not_found")
    return model or served_id


def read_messages(body: dict[str, Any], tool_format: ToolFormat = JSON) -> list[dict[str, Any]]:
    if "messages" not in body or body["messages"] is None:
        raise invalid("'messages' is required: a non-empty array of {'role', 'content'}", "messages",
                      "missing_required_parameter")
    msgs = body["messages"]
    if not isinstance(msgs, list):
        raise invalid(f"'messages' must be an array, got {kind_of(msgs)}", "messages")
    if not msgs:
        raise invalid("'messages' must be a non-empty array: at least one message is needed", "messages")
    out = []
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(f"'{p}' must be an object with 'role' and 'content', got {kind_of(m)}", p)
        role = m.get("role")
        if not isinstance(role, str):
            raise invalid(f"'{p}.role' is required: one of {', '.join(ROLES)}", f"{p}.role")
        if role not in ROLES:
            raise invalid(f"'{p}.role' must be one of {', '.join(ROLES)}, got {short(role)}", f"{p}.role")
        content = m.get("content")
        if content is None:
            if role != "assistant":
                raise invalid(f"'{p}.content' is required for role '{role}'", f"{p}.content")
            content = ""
        elif isinstance(content, list):
            content = content_parts(content, f"{p}.content")
        elif not isinstance(content, str):
            raise invalid(f"'{p}.content' must be a string or an array of text parts, got {kind_of(content)}",
                          f"{p}.content")
        text = checked_text(content, f"{p}.content")
        if role == "assistant" and m.get("tool_calls") is not None:  # its calls, as the model writes them
            out.append(tool_format.history(text, history_calls(m["tool_calls"], f"{p}.tool_calls")))
            continue
        out.append({"role": "system" if role == "developer" else role, "content": text})
    return tool_format.conversation(out)


def content_parts(parts: list[Any], param: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """Text parts ({"type": one of `kinds`, "text": ...}) joined by newlines; any other part is a 400 naming it."""
    texts = []
    for j, part in enumerate(parts):
        q = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise invalid(f"'{q}' must be an object like {{'type': '{kinds[0]}', 'text': ...}}, got {kind_of(part)}", q)
        if part.get("type") not in kinds:
            raise invalid(f"'{q}.type' {short(part.get('type'))} is not supported: this model reads text parts "
                          "only", f"{q}.type", "unsupported_content")
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"'{q}.text' must be a string, got {kind_of(text)}", f"{q}.text")
        texts.append(text)
    return "\n".join(texts)


def _prompts(body: dict[str, Any], vocab_size: int) -> list[Prompt]:
    """A string or an array of token ids (one prompt), or an array of those (one prompt each)."""
    if "prompt" not in body or body["prompt"] is None:
        raise invalid("'prompt' is required: a string, an array of token ids, or an array of those", "prompt",
                      "missing_required_parameter")
    p = body["prompt"]
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        if len(p) > MAX_CHOICES:
            raise invalid(f"'prompt' holds {len(p)} prompts; at most {MAX_CHOICES} per request (send the rest as "
                          "further requests)", "prompt", "too_many_prompts")
        return [_prompt(x, f"prompt[{i}]", vocab_size) for i, x in enumerate(p)]
    return [_prompt(p, "prompt", vocab_size)]


def _prompt(p: Any, param: str, vocab_size: int) -> Prompt:
    if isinstance(p, str):
        return Prompt(text=checked_text(p, param))
    if isinstance(p, list):
        if not p:
            raise invalid(f"'{param}' is an empty array: expected a string or token ids", param)
        return Prompt(token_ids=read_token_ids(p, param, vocab_size, "a string or an array of integer token ids"))
    raise invalid(f"'{param}' must be a string or an array of token ids, got {kind_of(p)}", param)


def read_token_ids(p: list[Any], param: str, vocab_size: int, expected: str) -> list[int]:
    for t in p:
        if isinstance(t, bool) or not isinstance(t, int):
            raise invalid(f"'{param}' must be {expected}, found {kind_of(t)}", param)
        if not 0 <= t < vocab_size:
            raise invalid(f"'{param}' token id {t} is outside the vocabulary (0..{vocab_size - 1})", param)
    return list(p)


def _stop(f: Fields) -> tuple[str, ...]:
    v = f.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise invalid(f"'stop' must be a string or an array of up to {MAX_STOP} strings, got {short(v)}", "stop")
    if len(items) > MAX_STOP:
        raise invalid(f"'stop' has {len(items)} strings: at most {MAX_STOP} are allowed", "stop")
    if any(not s for s in items):
        raise invalid("'stop' strings must be non-empty", "stop")
    return tuple(checked_text(s, "stop") for s in items)


def _logit_bias(f: Fields, vocab_size: int) -> dict[int, float]:
    v = f.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise f.wrong("logit_bias", "an object mapping token ids to numbers in [-100, 100]")
    out = {}
    for k, b in v.items():
        try:
            tid = int(k)
        except ValueError:
            raise invalid(f"'logit_bias' key {k!r} is not a token id (an integer as a string)", "logit_bias") from None
        if not 0 <= tid < vocab_size:
            raise invalid(f"'logit_bias' token id {tid} is outside the vocabulary (0..{vocab_size - 1})",
                          "logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or not -100 <= b <= 100:
            raise invalid(f"'logit_bias' value for {k} must be a number in [-100, 100], got {short(b)}",
                          "logit_bias")
        out[tid] = float(b)
    return out


def _speculative(f: Fields, s: dict[str, Any]) -> None:
    """`speculative` absent (or null): the server's default; "off": plain decoding; else an engine mode."""
    mode = f.string("speculative")
    if mode is not None:
        allowed = (*SPECULATIVE_MODES, SPECULATIVE_OFF)
        if mode not in allowed:
            raise invalid(f"'speculative' must be one of {', '.join(map(repr, allowed))}, got {short(mode)}",
                          "speculative", "unsupported_value")
        s["speculative"] = None if mode == SPECULATIVE_OFF else mode
    k = f.integer("num_draft_tokens", 1, MAX_DRAFT_TOKENS)
    if k is not None:
        s["num_draft_tokens"] = k


def _response_format(f: Fields, s: dict[str, Any]) -> None:
    """OpenAI's `response_format`: text, json_object (JSON mode) or json_schema ({"name", "schema", "strict",
    "description"}; a missing schema means any JSON object). Objects that do not say are closed (`closed`), and with
    `strict` every property is required, as OpenAI's strict replies carry every key. A schema the grammar cannot
    hold a reply to is a 400 naming `response_format.json_schema.schema` (`_held_schema`)."""
    v = f.get("response_format")
    if v is None:
        return
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise invalid("'response_format' must be an object like {'type': 'json_object'}", "response_format")
    kind = v["type"]
    if kind == "text":
        return
    if kind == "json_object":
        s["response_format"] = ResponseFormat("json_object")
        return
    if kind != "json_schema":
        raise invalid(f"response_format type {kind!r} is not supported: expected 'text', 'json_object' or "
                      "'json_schema'", "response_format.type", "unsupported_value")
    spec = v.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid("response_format of type 'json_schema' needs 'json_schema': an object like {'name': ..., "
                      f"'schema': {{...}}}}, got {kind_of(spec)}", "response_format.json_schema")
    for name, kinds, expected in (("name", str, "a string"), ("description", str, "a string"),
                                  ("strict", bool, "a boolean"), ("schema", dict, "a JSON Schema object")):
        if spec.get(name) is not None and not isinstance(spec[name], kinds):
            raise invalid(f"'response_format.json_schema.{name}' must be {expected}, got {kind_of(spec[name])}",
                          f"response_format.json_schema.{name}")
    schema = spec.get("schema")
    s["response_format"] = (_held_schema(closed(schema, require_all=bool(spec.get("strict"))),
                                         "response_format.json_schema.schema")
                            if schema is not None else ResponseFormat("json_object"))


def _held_schema(schema: dict[str, Any], param: str) -> ResponseFormat:
    """The format holding a reply to `schema`, checked now (no model needed): a schema llguidance cannot compile, or
    one that admits no value, is a 400 naming `param` with the compiler's one-line reason, never a 500 later."""
    error = schema_error(schema)
    if error is not None:
        raise invalid(f"'{param}' is not a JSON Schema a reply can be held to: {error}", param, "invalid_schema")
    return ResponseFormat("json_schema", schema=schema)


GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _guided(f: Fields, s: dict[str, Any], job: Job) -> None:
    """vLLM's structured-output fields, for clients written against vLLM: `guided_json`, `guided_regex`,
    `guided_choice`, `guided_grammar` (GBNF, or Lark), or their newer form `structured_outputs` ({"json", "regex",
    "choice", "grammar"}). At most one, and not with `response_format`."""
    given: dict[str, Any] = {}
    so = f.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise f.wrong("structured_outputs", "an object like {'json': {...}}")
        given.update({f"structured_outputs.{k}": v for k, v in so.items()
                      if k in ("json", "regex", "choice", "grammar") and v is not None})
    given.update({k: f.get(k) for k in GUIDED if f.get(k) is not None})
    if not given:
        return
    name, v = next(iter(given.items()))
    if len(given) > 1 or "response_format" in s:
        others = (["response_format"] if "response_format" in s else []) + list(given)
        raise invalid(f"only one of {', '.join(others)} may be set", name)
    kind = name.rsplit(".", 1)[-1].removeprefix("guided_")
    job.format_param = name
    if kind == "json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError as e:
                raise invalid(f"'{name}' is not valid JSON ({e})", name) from None
        if not isinstance(v, dict):
            raise invalid(f"'{name}' must be a JSON Schema object, got {kind_of(v)}", name)
        s["response_format"] = _held_schema(closed(v), name)
    elif kind == "regex":
        if not isinstance(v, str):
            raise invalid(f"'{name}' must be a string, got {kind_of(v)}", name)
        s["response_format"] = ResponseFormat("regex", pattern=v)
    elif kind == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise invalid(f"'{name}' must be a non-empty array of non-empty strings", name)
        s["response_format"] = ResponseFormat("lark", grammar="start: " + " | ".join(json.dumps(c) for c in v))
    else:
        if not isinstance(v, str):
            raise invalid(f"'{name}' must be a string (a GBNF or Lark grammar), got {kind_of(v)}", name)
        if "::=" in v:  # GBNF, as vLLM's xgrammar and llama.cpp take
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                v = gbnf_to_lark(v)
            except Exception as e:  # noqa: BLE001 - the converter raises its own error types
                raise invalid(f"'{name}' is not a grammar this server reads: {e}", name) from None
        s["response_format"] = ResponseFormat("lark", grammar=v)


def _reasoning(f: Fields, job: Job) -> None:
    """`chat_template_kwargs` (an object of template variables, none of the request's own names) and
    `reasoning_effort` (REASONING_EFFORTS): chat only, since a completion's prompt is not rendered by the template."""
    if job.endpoint != "chat":
        for name in ("chat_template_kwargs", "reasoning_effort"):
            if f.get(name) is not None:
                raise invalid(f"'{name}' is for /v1/chat/completions and /v1/responses: a completion's prompt is sent "
                              "as it is, not rendered by the chat template", name, "unsupported_value")
        return
    variables = f.get("chat_template_kwargs")
    if variables is not None:
        if not isinstance(variables, dict):
            raise f.wrong("chat_template_kwargs", "an object of template variables, like {\"enable_thinking\": false}")
        reserved = [k for k in variables if k in RESERVED_TEMPLATE_VARIABLES]
        if reserved:
            raise invalid(f"'chat_template_kwargs' cannot set {reserved[0]!r}: it is the request's own field, not a "
                          "template variable", "chat_template_kwargs")
        job.chat_template_kwargs = variables
    effort = f.string("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise invalid(f"'reasoning_effort' must be one of {', '.join(map(repr, REASONING_EFFORTS))}, got "
                      f"{short(effort)}", "reasoning_effort", "unsupported_value")
    job.reasoning_effort = effort


def _tools(body: dict[str, Any], job: Job, s: dict[str, Any]) -> None:
    """Chat `tools`: the conversation offers them and the reply is held to a call of them, in the model's tool-call
    format (`tool_formats.py`)."""
    if job.endpoint != "chat":
        for name in ("tools", "tool_choice", "functions", "function_call"):
            if body.get(name) is not None:
                raise invalid(f"'{name}' is for /v1/chat/completions; completions have no tool calling", name,
                              "unsupported_value")
        return
    job.tools = parse_tools(body)
    if job.tools is None:
        return
    if "response_format" in s:
        raise invalid(f"'{job.format_param}' cannot be combined with 'tools': a tool-calling reply is held to the "
                      "tool call format", job.format_param, "unsupported_value")
    if job.logprobs:
        raise invalid("'logprobs' is not supported with 'tools' (the reply's tokens are the tool-call format's)",
                      "logprobs", "unsupported_value")
    assert job.messages is not None
    job.format_param = "tools"  # the grammar comes from their schemas
    job.messages, job.tool_variables = job.tool_format.render(job.messages, job.tools)
    s["response_format"] = job.tool_format.grammar(job.tools)
