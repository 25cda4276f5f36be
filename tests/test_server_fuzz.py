"""Any JSON body, however wrong, is a Job or a 4xx: the request parsers raise nothing but APIError, and what they
accept the engine's own types accept (or refuse with a RequestError, which the server answers with a 400)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_engine.api import RequestError, SamplingParams
from mlx_engine.reasoning import template_kwargs

from app.server.errors import APIError
from app.server.protocol import parse_job
from app.server.responses_api import parse_responses

json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=16,
)


def near(*examples: object) -> st.SearchStrategy:
    """Plausible values (most requests are nearly right) or anything at all."""
    return st.sampled_from(examples) | json_value


message = st.fixed_dictionaries({"role": near("user", "assistant", "system", "tool", "developer")},
                                optional={"content": near("hi", None, [{"type": "text", "text": "x"}]),
                                          "tool_calls": near([{"id": "c", "type": "function", "function": {
                                              "name": "f", "arguments": "{}"}}]),
                                          "tool_call_id": near("c")})
tool = near({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}}}}}, {"type": "function", "function": {"name": "g"}})
FIELDS = {
    "max_tokens": near(0, 1, 5, 63, 64, -1), "max_completion_tokens": near(3), "temperature": near(0, 0.7, 2.5),
    "top_p": near(0.9, 0), "n": near(1, 2, 65), "stop": near("\n", ["a", "b"]), "seed": near(1),
    "logprobs": near(True, 2, 21), "top_logprobs": near(3), "logit_bias": near({"5": 1}, {"x": 1}),
    "response_format": near({"type": "json_object"}, {"type": "json_schema", "json_schema": {"schema": {}}}),
    "tools": st.lists(tool, max_size=3) | json_value,
    "tool_choice": near("auto", "required", "none", {"type": "function", "function": {"name": "f"}}),
    "parallel_tool_calls": near(True), "stream": near(True), "stream_options": near({"include_usage": True}),
    "guided_json": near({"type": "object"}, "{}"), "guided_regex": near("[a-z]+"), "guided_choice": near(["a"]),
    "guided_grammar": near('root ::= "a"'), "structured_outputs": near({"regex": "x"}), "top_k": near(-1, 5),
    "min_p": near(0.1, 1), "repetition_penalty": near(1.1, 0), "ignore_eos": near(True),
    "speculative": near("auto", "off", "nope"), "num_draft_tokens": near(4, 17), "echo": near(True),
    "best_of": near(1, 2), "suffix": near("x"), "user": near("u"), "presence_penalty": near(1, 3),
    "reasoning_effort": near("none", "high", "max"),
    "chat_template_kwargs": near({"enable_thinking": False}, {"add_generation_prompt": True}),
}
chat_body = st.fixed_dictionaries({"model": near("fake", "other")},
                                  optional={"messages": st.lists(message, max_size=4) | json_value, **FIELDS})
completion_body = st.fixed_dictionaries({"model": near("fake")},
                                        optional={"prompt": near("hi", [1, 2], [[1], "a"], []), **FIELDS})
input_item = near({"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                      "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c", "output": "ok"},
                  {"role": "user", "content": [{"type": "input_text", "text": "x"}]})
responses_body = st.fixed_dictionaries({"model": near("fake")}, optional={
    "input": near("hi") | st.lists(input_item, max_size=3), "instructions": near("be brief"),
    "max_output_tokens": near(5, 0), "text": near({"format": {"type": "json_object"}}),
    "tools": st.lists(near({"type": "function", "name": "f"}, {"type": "web_search"}), max_size=2) | json_value,
    "tool_choice": near("auto", {"type": "function", "name": "f"}), "previous_response_id": near("r"),
    "temperature": near(0.5), "stream": near(True), "reasoning": near({"effort": "low"}, {"effort": "x"}, "high")})


def engine_accepts(job) -> None:
    """What the server does next with a Job: the template's variables (never refused once parsed), SamplingParams
    from it (a RequestError is a 400 there)."""
    template_kwargs("think", job.chat_template_kwargs, job.reasoning_effort)
    try:
        SamplingParams(max_tokens=job.max_tokens if job.max_tokens is not None else 16,
                       prompt_logprobs=job.top_logprobs if job.echo and job.logprobs else
                       (0 if job.max_tokens == 0 else None), **job.sampling)
    except RequestError:
        pass


FUZZ = settings(max_examples=int(__import__("os").environ.get("FUZZ_EXAMPLES", "900")), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def parse(kind: str, body: dict):
    if kind == "responses":
        return parse_responses(body, {"fake"}, "fake", context_length=64, vocab_size=1000)
    return parse_job(body, kind, {"fake"}, "fake", context_length=64, vocab_size=1000)  # type: ignore[arg-type]


@FUZZ
@given(case=st.one_of(chat_body.map(lambda b: ("chat", b)), completion_body.map(lambda b: ("completion", b)),
                      responses_body.map(lambda b: ("responses", b))))
def test_any_body_is_a_job_or_a_4xx(case: tuple[str, dict]) -> None:
    kind, body = case
    try:
        job = parse(kind, body)
    except APIError as e:
        assert 400 <= e.status < 500 and e.message
        return
    engine_accepts(job)


@pytest.mark.parametrize("depth", [50, 450])
def test_deeply_nested_tool_parameters_parse_or_refuse(depth: int) -> None:
    """Nesting as deep as the body parser allows: the tool prompt and schema build, or the schema compiler refuses
    what is too deep with a 400 naming the tool's parameters."""
    from app.server.fields import parse_body

    deep = '{"type":"object","properties":{"a":' * depth + "{}" + "}}" * depth
    raw = ('{"model":"fake","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":'
           '{"name":"f","parameters":%s}}]}' % deep).encode()
    try:
        job = parse_job(parse_body(raw), "chat", {"fake"}, "fake", context_length=64, vocab_size=1000)
    except APIError as e:
        assert (e.status, e.param) == (400, "tools[0].function.parameters") and depth > 50, e.message
        return
    assert job.tools is not None and job.sampling["response_format"].type == "json_schema"
