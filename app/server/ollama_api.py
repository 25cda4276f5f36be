"""Ollama's /api/chat and /api/generate: its request bodies translated to OpenAI's and validated there (errors
renamed back to the fields Ollama's clients sent: 'options.temperature', not 'temperature'), and its replies (one
JSON object, or NDJSON lines ending with a `done: true` one carrying counts and durations in nanoseconds).

`options` map onto the sampling (temperature, top_p, top_k, min_p, seed, stop, num_predict -> max tokens,
repeat_penalty -> repetition penalty, presence/frequency penalties); `num_ctx` is accepted and the model keeps the
context it was loaded with (set per model in models.toml); options this engine has no use for (num_gpu, num_thread,
mirostat, ...) are ignored, as Ollama ignores those a runner does not take. `format` "json" or a JSON Schema holds
the reply to it; `think` false turns a reasoning model's thinking off, "low"/"medium"/"high" pick its effort;
`tools` and `tool_calls` are OpenAI's functions with arguments as objects. `images` are refused: the models served
here read text.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from mlx_engine.api import GenerationEvent, ModelInfo, Usage

from app.server.bridge import Generation
from app.server.errors import APIError, invalid
from app.server.fields import kind_of
from app.server.harmony_tools import tool_reply
from app.server.protocol import Job, parse_job
from app.server.responses import Choice
from app.toolcalls.tool_formats import ToolFormat

OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
           "stop": "stop", "num_predict": "max_tokens", "repeat_penalty": "repetition_penalty",
           "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
# the OpenAI field a translated body's error names -> the field the Ollama client sent
_BACK = {v: f"options.{k}" for k, v in OPTIONS.items()} | {
    "response_format": "format", "response_format.json_schema.schema": "format", "reasoning_effort": "think",
    "chat_template_kwargs": "think"}


def iso_now() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


def _images(v: Any, where: str) -> None:
    if v is not None and v != []:
        raise invalid(f"'{where}': this model reads text only, so images cannot be sent to it", where,
                      "unsupported_content")


def _messages(msgs: Any) -> list[dict[str, Any]]:
    """Ollama's messages -> OpenAI's: images refused, tool calls' arguments (objects) as JSON text."""
    if not isinstance(msgs, list):
        raise invalid(f"'messages' must be an array, got {kind_of(msgs)}", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise invalid(f"'messages[{i}]' must be an object with 'role' and 'content', got {kind_of(m)}",
                          f"messages[{i}]")
        _images(m.get("images"), f"messages[{i}].images")
        msg = {"role": m.get("role"), "content": m.get("content")}
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise invalid(f"'messages[{i}].tool_calls' must be an array", f"messages[{i}].tool_calls")
            converted = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise invalid(f"'messages[{i}].tool_calls[{j}]' must be like {{'function': {{'name': ..., "
                                  "'arguments': {...}}}}", f"messages[{i}].tool_calls[{j}]")
                args = fn.get("arguments", {})
                converted.append({"id": f"call_{i}_{j}", "type": "function", "function": {
                    "name": fn["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
            msg["tool_calls"] = converted
        out.append(msg)
    return out


def _renamed(e: APIError) -> APIError:
    """An error from the translated body, naming the field as the Ollama client sent it."""
    if e.param is not None:
        ollama = _BACK.get(e.param) or _BACK.get(e.param.split("[")[0].split(".")[0])
        if ollama is not None:
            for name in sorted({e.param, e.param.split("[")[0].split(".")[0]}, key=len, reverse=True):
                e.message = e.message.replace(f"'{name}'", f"'{ollama}'")
            e.param = ollama
    return e


def translate(body: dict[str, Any], kind: str) -> tuple[dict[str, Any], str]:
    """An Ollama body -> (an OpenAI body, "chat" or "completion"). Raises APIError for Ollama's own fields."""
    oa: dict[str, Any] = {k: body[k] for k in OPTIONS.values() if body.get(k) is not None}  # models.toml defaults
    oa["model"] = body.get("model")
    options = body.get("options")
    if options is not None:
        if not isinstance(options, dict):
            raise invalid(f"'options' must be an object like {{'temperature': 0.7}}, got {kind_of(options)}",
                          "options")
        for k, v in options.items():
            if k in OPTIONS and v is not None:
                oa[OPTIONS[k]] = v
        if oa.get("max_tokens") in (-1, -2):  # Ollama's "no limit" and "fill the context"
            del oa["max_tokens"]
        ctx = options.get("num_ctx")
        if ctx is not None and (isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 1):
            raise invalid(f"'options.num_ctx' must be an integer >= 1, got {ctx!r}", "options.num_ctx")
    stream = body.get("stream", True)
    if stream is not None and not isinstance(stream, bool):
        raise invalid(f"'stream' must be a boolean, got {kind_of(stream)}", "stream")
    oa["stream"] = stream is not False
    fmt = body.get("format")
    if fmt == "json":
        oa["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        oa["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise invalid(f"'format' must be \"json\" or a JSON Schema object, got {json.dumps(fmt)[:40]}", "format")
    think = body.get("think")
    if think is False:
        oa["reasoning_effort"] = "none"
    elif isinstance(think, str) and think in ("low", "medium", "high"):
        oa["reasoning_effort"] = think
    elif think not in (None, True):
        raise invalid(f"'think' must be true, false, \"low\", \"medium\" or \"high\", got {json.dumps(think)[:40]}",
                      "think")
    if kind == "chat":
        oa["messages"] = _messages(body.get("messages"))
        if body.get("tools") is not None:
            oa["tools"] = body["tools"]
        return oa, "chat"
    _images(body.get("images"), "images")
    for name, why in (("suffix", "fill-in-the-middle is not supported"),
                      ("template", "a per-request template is not supported: start the server with --chat-template"),
                      ("context", "the context of an earlier reply is not supported: send the conversation to "
                       "/api/chat")):
        if body.get(name) not in (None, "", []):
            raise invalid(f"'{name}': {why}", name, "unsupported_value")
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise invalid(f"'prompt' must be a string, got {kind_of(prompt)}", "prompt")
    if body.get("raw") is True:
        if think is not None:
            raise invalid("'think' needs the chat template, which 'raw' skips", "think")
        oa["prompt"] = prompt
        return oa, "completion"
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise invalid(f"'system' must be a string, got {kind_of(system)}", "system")
    oa["messages"] = ([{"role": "system", "content": system}] if system else []) + [{"role": "user",
                                                                                   "content": prompt}]
    return oa, "chat"


def parse_ollama(body: dict[str, Any], kind: str, name: str, info: ModelInfo, tool_format: ToolFormat) -> Job:
    oa, endpoint = translate(body, kind)
    try:
        job = parse_job(oa, endpoint, {name}, name, info.context_length, info.vocab_size,  # type: ignore[arg-type]
                        tool_format)
    except APIError as e:
        if kind == "generate" and e.param is not None and e.param.startswith("messages"):
            # generate's prompt (and system) went in as messages: the last one is the prompt
            last = len(oa.get("messages") or ()) - 1
            sent = "system" if e.param.startswith("messages[0]") and last == 1 else "prompt"
            e.message = re.sub(r"'messages(\[\d+\](\.content)?)?'", f"'{sent}'", e.message)
            e.message = e.message.replace("the messages are", f"the {sent} is")
            e.param = sent
        raise _renamed(e) from None
    if kind == "generate":
        job.prompt_param = "prompt"
    if job.format_param == "response_format":  # what the engine's errors on the grammar will name
        job.format_param = "format"
    return job


def is_load_only(body: dict[str, Any], kind: str) -> bool:
    """A body with no prompt (or no messages): Ollama's way to load a model, or with keep_alive 0 to unload it."""
    return not body.get("messages") if kind == "chat" else body.get("prompt") in (None, "") and not body.get("images")


def ollama_calls(calls: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """OpenAI tool_calls -> Ollama's: arguments as an object."""
    out = []
    for i, c in enumerate(calls or ()):
        args = c["function"]["arguments"]
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        out.append({"id": c.get("id"), "function": {"index": i, "name": c["function"]["name"], "arguments": args}})
    return out


class OllamaFormatter:
    """One /api/chat or /api/generate request's reply (n = 1)."""

    def __init__(self, job: Job, model: str, chat: bool):
        self.job = job
        self.model = model
        self.chat = chat
        self.t0 = time.perf_counter()

    def piece(self, text: str, thinking: str = "", calls: list[dict[str, Any]] | None = None,
              done: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": iso_now()}
        if self.chat:
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                msg["thinking"] = thinking
            if calls:
                msg["tool_calls"] = ollama_calls(calls)
            out["message"] = msg
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        out["done"] = done
        return out

    def reply(self, text: str, engine_calls: Any) -> tuple[str, list[dict[str, Any]] | None]:
        if self.job.tools is None:
            return text, None
        content, calls = tool_reply(self.job.tool_format, text, engine_calls, self.job.tools)
        return content or "", calls

    def final(self, reason: str, usage: Usage, called: bool, ttft_s: float | None = None,
              decode_s: float | None = None) -> dict[str, Any]:
        total = time.perf_counter() - self.t0
        prompt_s = ttft_s if ttft_s is not None else 0.0
        return {"done_reason": "stop" if called else {"length": "length"}.get(reason, "stop"),
                "total_duration": int(total * 1e9), "load_duration": 0,
                "prompt_eval_count": usage.prompt_tokens, "prompt_eval_duration": int(prompt_s * 1e9),
                "eval_count": usage.completion_tokens,
                "eval_duration": int((decode_s if decode_s is not None else total - prompt_s) * 1e9)}

    def response(self, choices: list[Choice], usage: Usage, accepted: int | None) -> dict[str, Any]:
        c = choices[0]
        text, calls = self.reply(c.text, c.tool_calls)
        return {**self.piece(text, c.reasoning, calls, done=True), **self.final(c.finish_reason, usage, bool(calls))}


def line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


async def ollama_events(fmt: OllamaFormatter, gen: Generation, on_event: Callable[[GenerationEvent], None],
                        cancelled_message: Callable[[], str]) -> AsyncIterator[bytes]:
    """NDJSON over one generation: a line per engine event, then the `done` line. Under tools the text is held back
    until it is known not to be a call; calls go out whole in the last message. A failure mid-stream is an
    `{"error": ...}` line, as Ollama ends a broken stream."""
    held = fmt.job.tool_format.stream(fmt.job.tools) if fmt.job.tools is not None else None
    parts: list[str] = []
    sent = ""
    final: GenerationEvent | None = None
    async for event in gen.events():
        on_event(event)
        final = event
        if event.finish_reason is not None:
            break
        parts.append(event.text)
        delta = event.text if held is None else "".join(d.content or "" for d in held.feed(event.text))
        sent += delta
        if delta or event.reasoning:
            yield line(fmt.piece(delta, event.reasoning))
    assert final is not None and final.finish_reason is not None
    if final.finish_reason in ("error", "cancelled"):
        yield line({"error": f"the generation failed: {final.error}" if final.finish_reason == "error"
                    else cancelled_message()})
        return
    text, calls = fmt.reply("".join(parts) + final.text, final.tool_calls)
    rest = text[len(sent):] if text.startswith(sent) else ""
    stats = final.stats
    decode = (final.usage.completion_tokens / stats.decode_tps if stats is not None and stats.decode_tps and
              final.usage is not None else None)
    yield line({**fmt.piece(rest, "", calls, done=True),
                **fmt.final(final.finish_reason, final.usage or Usage(gen.prompt_tokens, 0), bool(calls),
                            stats.ttft_s if stats is not None else None, decode)})
