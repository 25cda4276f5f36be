"""vLLM's tokenizer routes' bodies (`/tokenize`, `/detokenize`): what lm-evaluation-harness's `local-completions`
sends to tokenize through the server, with no tokenizer download."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.server.errors import invalid
from app.server.fields import Fields, checked_text, or_default
from app.server.protocol import check_model, read_messages, read_token_ids
from app.toolcalls.tool_formats import JSON, ToolFormat


@dataclass
class TokenizeJob:
    """A validated /tokenize body (vLLM's shape): a prompt, or messages through the chat template."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


def parse_tokenize(body: dict[str, Any], model_names: set[str], served_id: str, tool_format: ToolFormat = JSON
                   ) -> TokenizeJob:
    """/tokenize: {"prompt": str} or {"messages": [...]} (earlier calls in the model's `tool_format`), `model`
    optional. Raises APIError (4xx)."""
    f = Fields(body)
    check_model(f, model_names, served_id)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise invalid("send either 'prompt' (a string) or 'messages' (an array of {'role', 'content'}), not both",
                      "prompt" if has_prompt else None, None if has_prompt else "missing_required_parameter")
    job = TokenizeJob()
    if has_prompt:
        job.prompt = checked_text(f.string("prompt") or "", "prompt")
    else:
        job.messages = read_messages(body, tool_format)
    job.add_special_tokens = or_default(f.boolean("add_special_tokens"), True)
    job.add_generation_prompt = or_default(f.boolean("add_generation_prompt"), True)
    job.return_token_strs = or_default(f.boolean("return_token_strs"), False)
    return job


def parse_detokenize(body: dict[str, Any], model_names: set[str], served_id: str, vocab_size: int) -> list[int]:
    """/detokenize: {"tokens": [ids]} -> the ids. Raises APIError (4xx)."""
    f = Fields(body)
    check_model(f, model_names, served_id)
    tokens = body.get("tokens")
    if tokens is None:
        raise invalid("'tokens' is required: an array of token ids", "tokens", "missing_required_parameter")
    if not isinstance(tokens, list):
        raise f.wrong("tokens", "an array of integer token ids")
    return read_token_ids(tokens, "tokens", vocab_size, "an array of integer token ids")
