"""One loaded model as the server serves it: its engine, the names it answers to, how it calls tools, and turning a
validated Job into engine requests (tokenized, checked against the context, submitted all or none)."""

from __future__ import annotations

import hashlib
import time
from typing import Any

from mlx_engine.api import EngineLike, GenerationRequest, RequestError, RooflineError, SamplingParams
from mlx_engine.reasoning import template_kwargs

from app.server.anthropic_reply import MessagesFormatter, model_card
from app.server.config import ServerConfig
from app.server.errors import APIError, from_request_error, invalid
from app.server.harmony_tools import tool_format_for
from app.server.metrics import KVStatsReader
from app.server.protocol import Job, model_slug
from app.server.responses import Echo, Formatter, token_bytes_fn
from app.server.responses_api import ResponsesFormatter

_PARAM_NAMES = {"logprobs": "top_logprobs"}  # SamplingParams field -> request field, where they differ


class Served:
    """A loaded engine and what the routes need of it. `model_id`: the name replies carry (the slug of the model's
    name when one model is served, else the name the request used, as /v1/models lists it)."""

    def __init__(self, engine: EngineLike, model_id: str | None = None):
        self.engine = engine
        info = engine.info
        self.info = info
        self.reasons = info.reasoning is not None  # replies carry reasoning apart from the answer
        self.model_id = model_id or model_slug(info.name)
        self.model_names = {self.model_id, "default", info.name}
        digest = hashlib.sha256(f"{info.name}|{info.path}|{info.quantization}|{info.dtype}".encode()).hexdigest()
        self.fingerprint = "fp_" + digest[:10]
        self.created = int(time.time())
        self.kv = KVStatsReader(engine.kv_stats)
        self.token_bytes = token_bytes_fn(engine.tokenizer)
        # how this model calls tools: harmony's, or from its chat template's text (no template: the JSON format)
        self.tool_format = tool_format_for(info.reasoning, getattr(engine.tokenizer, "chat_template", None),
                                           lambda text: engine.tokenizer.encode(text, add_special_tokens=False))

    def model_card(self) -> dict[str, Any]:
        i = self.info
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "roofline",
                "name": i.name, "context_length": i.context_length, "quantization": i.quantization,
                "model_type": i.model_type, "num_parameters": i.num_parameters,
                "backend": i.backend, "device": i.device}  # what Engine.load's backend="auto" chose

    def anthropic_card(self) -> dict[str, Any]:
        return model_card(self.model_id, self.info.name, self.created)

    def encode_chat(self, job: Job) -> list[int]:
        """A chat job's prompt ids: its messages through the chat template, with the job's template variables."""
        assert job.messages is not None
        variables = template_kwargs(self.info.reasoning, job.chat_template_kwargs, job.reasoning_effort)
        return self.engine.tokenizer.encode_chat(job.messages, add_generation_prompt=True,
                                                 **{**variables, **job.tool_variables})

    def submit(self, job: Job, fmt: Any, config: ServerConfig) -> list[tuple[Any, int]]:
        """On a worker thread: tokenize every prompt and check it against the context, score the echoed prompts,
        then start a generation per prompt (all or none)."""
        tok = self.engine.tokenizer
        try:
            if job.messages is not None:
                prompts = [(self.encode_chat(job), job.prompt_param, None)]
            else:
                prompts = [(tok.encode(p.text) if p.text is not None else list(p.token_ids or ()),
                            "prompt" if len(job.prompts) == 1 else f"prompt[{i}]", p.text)
                           for i, p in enumerate(job.prompts)]
            requests = [replies for ids, what, _ in prompts for replies in self._requests(job, ids, what, config)]
            if job.echo:  # completions only
                assert isinstance(fmt, Formatter)
                for i, (ids, _, text) in enumerate(prompts):
                    for j in range(job.n):
                        fmt.echoes[i * job.n + j] = Echo(text if text is not None else tok.decode(ids), ids)
            submitted: list[tuple[Any, int]] = []
            try:
                for r in requests:
                    submitted.append((self.engine.generate(r), len(r.prompt_token_ids or ())))
            except BaseException:
                for stream, _ in submitted:
                    stream.cancel()
                raise
            return submitted
        except RequestError as e:
            err = from_request_error(str(e), _PARAM_NAMES)
            if err.param == "response_format":  # or the vLLM field the grammar came from
                err.param = job.format_param
                if job.tools is not None:  # each function's schema compiled alone at parsing; together they did not
                    err.message = "the tools' parameter schemas cannot be held together: " + err.message.split(
                        ": ", 2)[-1]
            raise err from None
        except RooflineError as e:
            raise APIError(503, f"the engine cannot take requests: {e}", None, "engine_unavailable") from None

    def _requests(self, job: Job, ids: list[int], what: str, config: ServerConfig) -> list[GenerationRequest]:
        """One prompt's n engine requests, checked against the context (`what` names the prompt in errors). With a
        seed, reply j samples with seed + j."""
        ctx, n = self.info.context_length, len(ids)
        if n == 0:  # "" on a model whose tokenizer adds no BOS: nothing to continue from
            raise invalid(f"'{what}' is empty: it gives no tokens, and this model adds none before a prompt; send some "
                          "text", what)
        if n >= ctx:
            verb = "are" if what == "messages" else "is"
            raise invalid(f"This model's maximum context length is {ctx} tokens, but the {what} {verb} {n} "
                          "tokens (at least 1 token must be left to generate)", what, "context_length_exceeded")
        if job.max_tokens is not None and n + job.max_tokens > ctx:
            raise invalid(f"This model's maximum context length is {ctx} tokens, but {n + job.max_tokens} were "
                          f"requested ({n} in the {what}, {job.max_tokens} in '{job.max_tokens_param}'); "
                          f"at most {ctx - n} can be generated for this prompt", job.max_tokens_param,
                          "context_length_exceeded")
        max_tokens = job.max_tokens
        if max_tokens is None:
            max_tokens = min(ctx - n, config.default_max_tokens or ctx)
        kw = dict(job.sampling)
        if "speculative" not in kw and config.speculative is not None:
            kw["speculative"] = config.speculative
        seed = kw.pop("seed", None)
        if job.echo and job.logprobs:  # the prompt's log-probabilities, scored in the batch's prefill chunks
            kw["prompt_logprobs"] = job.top_logprobs
        elif max_tokens == 0:  # echo without logprobs and no reply: the engine still reads the prompt, once
            kw["prompt_logprobs"] = 0
        return [GenerationRequest(prompt_token_ids=ids, chat_template_kwargs=job.chat_template_kwargs,
                                  sampling=SamplingParams(max_tokens=max_tokens,
                                                          seed=None if seed is None else seed + j, **kw))
                for j in range(job.n)]


FormatterLike = Formatter | ResponsesFormatter | MessagesFormatter
