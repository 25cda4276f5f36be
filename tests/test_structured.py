"""Structured output: a reply held to a regex, JSON or a JSON Schema is exactly the greedy (or sampled) choice among
the tokens the grammar allows, whole and valid, alone or batched with free requests, on both backends; bad formats
are refused before anything runs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from llguidance import LLMatcher

from mlx_engine import Engine, GenerationRequest, RequestError, ResponseFormat, SamplingParams
from mlx_engine.structured import check_format, grammar
from tests.support.tiny_models import random_llama_folder, write_gguf_from_folder

PATTERN = r"[a-c]{2,4}-[0-9]{1,3}"
PROMPT = [1, 72, 101, 108, 108, 111, 58, 32]  # BOS "Hello: " in the byte-level vocabulary
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                   "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "color", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random llama with a byte-level tokenizer (token i is byte i; BOS 1, EOS 2)."""
    root = tmp_path_factory.mktemp("structured")
    folder = random_llama_folder(root / "hf", vocab=160, seed=3)
    path = root / "tiny.gguf"
    write_gguf_from_folder(folder, path, {}, default_type="F32")
    return path


@pytest.fixture(scope="module")
def engine(tiny: Path):
    with Engine.load(str(tiny)) as e:
        yield e


def run(engine, fmt: ResponseFormat | None, prompt: list[int] = PROMPT, **kw):
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 40)
    events = list(engine.generate(GenerationRequest(prompt_token_ids=prompt,
                                                    sampling=SamplingParams(response_format=fmt, **kw))))
    tokens = [t for e in events for t in e.token_ids]
    return tokens, "".join(e.text for e in events), events


def reference_greedy(engine, fmt: ResponseFormat, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding by hand: full forwards from scratch, masked with a fresh matcher's allowed tokens."""
    from mlx_engine.structured import constrain

    c = constrain(engine.tokenizer, engine.info.vocab_size, fmt)
    out: list[int] = []
    while len(out) < max_tokens and not c.done:
        logits = engine.forward_logits(prompt + out)[-1]
        token = int(np.argmax(np.where(c.allowed(), logits, -np.inf)))
        if token in engine.info.eos_token_ids:
            break
        c.consume(token)
        out.append(token)
    return out


def test_greedy_regex_reply_is_the_masked_argmax_and_matches_whole(engine) -> None:
    fmt = ResponseFormat("regex", pattern=PATTERN)
    tokens, text, events = run(engine, fmt)
    assert tokens == reference_greedy(engine, fmt, PROMPT, 40)
    assert re.fullmatch(PATTERN, text), text
    assert events[-1].finish_reason == "stop"  # the grammar ended it, before max_tokens
    free, _, _ = run(engine, None)
    assert free != tokens  # the random model alone would write something else


def test_sampled_replies_always_match(engine) -> None:
    """Temperature 1 with top-k, 30 seeds: every reply matches the regex whole, and they differ."""
    texts = set()
    for seed in range(30):
        _, text, events = run(engine, ResponseFormat("regex", pattern=PATTERN), temperature=1.0, top_k=50, seed=seed)
        assert re.fullmatch(PATTERN, text), (seed, text)
        assert events[-1].finish_reason == "stop"
        texts.add(text)
    assert len(texts) > 10


def test_json_schema_reply_parses_and_obeys_the_schema(engine) -> None:
    fmt = ResponseFormat("json_schema", schema=SCHEMA)
    for seed in range(8):
        tokens, text, events = run(engine, fmt, temperature=1.0, seed=seed, max_tokens=400)
        assert events[-1].finish_reason == "stop", text
        value = json.loads(text)
        assert set(value) == {"ok", "color", "n"}
        assert isinstance(value["ok"], bool) and value["color"] in ("red", "green", "blue")
        assert isinstance(value["n"], int) and 0 <= value["n"] <= 99
    greedy, _, _ = run(engine, fmt, max_tokens=60)
    assert greedy == reference_greedy(engine, fmt, PROMPT, 60)


def test_a_grammar_that_fails_fails_only_its_request(engine, monkeypatch) -> None:
    """A grammar that dead-ends mid-reply (here: its mask fails after three tokens) ends that request with an
    error; the free and constrained requests batched with it go on to their own replies."""
    from mlx_engine.structured import Constraint

    allowed = Constraint.allowed

    def failing(self):
        if getattr(self, "doomed", False) and len(self.seen) >= 3:
            raise RuntimeError("lexer fuel exhausted")
        return allowed(self)

    consume = Constraint.consume

    def counting(self, token):
        self.seen = [*getattr(self, "seen", []), token]
        consume(self, token)

    monkeypatch.setattr(Constraint, "allowed", failing)
    monkeypatch.setattr(Constraint, "consume", counting)
    import mlx_engine.structured as st

    made = []
    original = st.constrain

    def constrain(*args):
        c = original(*args)
        c.seen = []
        made.append(c)
        return c

    monkeypatch.setattr(st, "constrain", constrain)
    want_free, _, _ = run(engine, None, max_tokens=10, ignore_eos=True)
    want_ok, _, _ = run(engine, ResponseFormat("regex", pattern=PATTERN), [1, 50, 51])
    fmt = ResponseFormat("regex", pattern=PATTERN)
    streams = [engine.generate(GenerationRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(
        temperature=0.0, max_tokens=40, response_format=fmt)))]
    made[-1].doomed = True
    streams.append(engine.generate(GenerationRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True))))
    streams.append(engine.generate(GenerationRequest(prompt_token_ids=[1, 50, 51], sampling=SamplingParams(
        temperature=0.0, max_tokens=40, response_format=fmt))))
    doomed, free, ok = (list(s) for s in streams)
    assert doomed[-1].finish_reason == "error" and "lexer fuel exhausted" in doomed[-1].error
    assert sum(len(e.token_ids) for e in doomed) == 3
    assert [t for e in free for t in e.token_ids] == want_free and free[-1].finish_reason == "length"
    assert [t for e in ok for t in e.token_ids] == want_ok and ok[-1].finish_reason == "stop"
    assert engine.kv_stats()["used"] == 0


def test_ignore_eos_runs_on_where_the_grammar_allows_more(engine) -> None:
    """With ignore_eos an end-of-sequence the grammar allowed is emitted and decoding goes on, still in the grammar."""
    for seed in range(6):
        tokens, text, events = run(engine, ResponseFormat("regex", pattern="[ab]+"), temperature=1.0, seed=seed,
                                   max_tokens=12, ignore_eos=True)
        assert events[-1].finish_reason == "length" and len(tokens) == 12
        assert set(tokens) <= {97, 98, *engine.info.eos_token_ids}


def test_json_object_reply_is_an_object(engine) -> None:
    _, text, events = run(engine, ResponseFormat("json_object"), temperature=0.8, seed=5, max_tokens=80)
    if events[-1].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut at max_tokens: still a prefix of an object
        assert events[-1].finish_reason == "length" and text.startswith("{")


def test_logprobs_are_the_masked_distribution(engine) -> None:
    """Each token's log-probability and its alternatives come from the distribution it was drawn from: the
    logits' log-softmax over the allowed tokens only."""
    from mlx_engine.structured import constrain

    fmt = ResponseFormat("regex", pattern=PATTERN)
    tokens, _, events = run(engine, fmt, logprobs=5)
    lps = [lp for e in events for lp in e.logprobs]
    c = constrain(engine.tokenizer, engine.info.vocab_size, fmt)
    for i, (token, lp) in enumerate(zip(tokens, lps)):
        allowed = c.allowed()
        x = np.where(allowed, engine.forward_logits(PROMPT + tokens[:i])[-1].astype(np.float64), -np.inf)
        want = x - np.log(np.exp(x - x.max()).sum()) - x.max()
        assert lp.token_id == token and lp.logprob == pytest.approx(want[token], abs=1e-4)
        assert [t for t, _ in lp.top] == [int(t) for t in np.argsort(-want)[: min(5, allowed.sum())]]
        assert all(allowed[t] for t, _ in lp.top)
        c.consume(token)


def test_batched_with_free_requests_each_gets_its_own_reply(engine) -> None:
    """Constrained and free requests in one batch: each gets exactly the tokens it gets alone."""
    jobs = [(ResponseFormat("regex", pattern=PATTERN), PROMPT, {}),
            (None, PROMPT, {"ignore_eos": True, "max_tokens": 12}),
            (ResponseFormat("json_schema", schema=SCHEMA), [1, 40, 41, 42], {"max_tokens": 60}),
            (None, [1, 99, 98, 97, 96], {"temperature": 1.0, "seed": 4, "max_tokens": 10, "ignore_eos": True}),
            (ResponseFormat("regex", pattern=PATTERN), [1, 50, 51], {"temperature": 1.0, "seed": 9})]
    alone = [run(engine, fmt, prompt, **kw)[0] for fmt, prompt, kw in jobs]
    streams = []
    for fmt, prompt, kw in jobs:
        kw = {"temperature": 0.0, "max_tokens": 40, **kw}
        streams.append(engine.generate(GenerationRequest(prompt_token_ids=prompt,
                                                         sampling=SamplingParams(response_format=fmt, **kw))))
    together = [[t for e in s for t in e.token_ids] for s in streams]
    assert together == alone
    assert engine.kv_stats()["used"] == 0


@pytest.fixture(scope="module")
def with_draft(tiny: Path, tmp_path_factory: pytest.TempPathFactory):
    """The tiny model with a draft of the same byte vocabulary (another random model: it is often rejected)."""
    root = tmp_path_factory.mktemp("draft")
    draft = root / "draft.gguf"
    write_gguf_from_folder(random_llama_folder(root / "hf", vocab=160, layers=1, seed=8), draft, {}, default_type="F32")
    with Engine.load(str(tiny), draft_model=str(draft)) as e:
        yield e


QUOTE = [1, *b"copy: abab-12 abab-12 ab"]  # prompt lookup finds "abab-12" to draft from


@pytest.mark.parametrize("mode", ["prompt-lookup", "self", "draft", "auto"])
def test_speculation_under_a_grammar_is_exact_greedy(with_draft, mode: str) -> None:
    """Every proposer drafts freely, the verification masks each row with the grammar after the drafts before
    it: greedy replies equal plain decoding's under the same format, and drafts that fit are accepted."""
    for fmt, prompt in ((ResponseFormat("regex", pattern=r"(ab){1,6}-[0-9]{2}"), QUOTE),
                        (ResponseFormat("json_schema", schema=SCHEMA), PROMPT)):
        plain, text, _ = run(with_draft, fmt, prompt, max_tokens=60)
        for k in (1, 4):
            tokens, _, events = run(with_draft, fmt, prompt, max_tokens=60, speculative=mode, num_draft_tokens=k)
            assert tokens == plain, (mode, k, fmt.type)
            assert mode == "auto" or events[-1].stats.acceptance_rate is not None  # drafts were verified
    drafted = [d for e in run(with_draft, ResponseFormat("regex", pattern=r"(ab){1,6}-[0-9]{2}"), QUOTE,
                              speculative="prompt-lookup")[2] for d in e.from_draft]
    assert mode != "prompt-lookup" or sum(drafted) >= 3  # the quote was drafted and accepted


@pytest.mark.parametrize("mode", ["prompt-lookup", "self", "draft"])
def test_sampled_speculative_replies_stay_in_the_grammar(with_draft, mode: str) -> None:
    for seed in range(12):
        _, text, events = run(with_draft, ResponseFormat("regex", pattern=PATTERN), QUOTE, temperature=1.0, top_k=40,
                              seed=seed, speculative=mode, num_draft_tokens=3)
        assert re.fullmatch(PATTERN, text) and events[-1].finish_reason == "stop", (mode, seed, text)


def test_speculative_sampling_under_a_grammar_is_lossless(with_draft, monkeypatch) -> None:
    """Temperature 4 (a flat masked distribution), the random draft model proposing 2 tokens: the first three
    tokens' distribution over the grammar's four strings matches the exact masked one (chi-square, p > 0.01), and
    accepting every draft that fits the grammar (no p/q test) fails the same test."""
    import mlx_engine.speculative.step as sp
    from tests.support.stats import chi2_pvalue

    fmt = ResponseFormat("regex", pattern="a[ab]b|b[ab]a")  # the third token's mask depends on the first
    prompt, T, n = [1, *b"abba abab: "], 4.0, 800
    e = with_draft
    allowed = [97, 98]

    def p(prefix: list[int]) -> np.ndarray:
        x = e.forward_logits(prompt + prefix)[-1].astype(np.float64)[allowed] / T
        z = np.exp(x - x.max())
        return z / z.sum()

    outcomes = ["aab", "abb", "baa", "bba"]
    exact = np.array([p([])[allowed.index(o.encode()[0])] * p([o.encode()[0]])[allowed.index(o.encode()[1])]
                      for o in outcomes])

    def sample() -> np.ndarray:
        streams = [e.generate(GenerationRequest(prompt_token_ids=prompt, sampling=SamplingParams(
            temperature=T, seed=seed, max_tokens=5, response_format=fmt, speculative="draft", num_draft_tokens=2)))
            for seed in range(n)]
        texts = ["".join(ev.text for ev in s) for s in streams]
        return np.array([texts.count(o) for o in outcomes])

    counts = sample()
    assert counts.sum() == n and chi2_pvalue(counts, exact) > 0.01, (counts, exact * n)

    def accept_all(p_, q, draft, key):  # every draft the grammar allows is kept (p > 0), then the bonus row
        ok = (mx.take_along_axis(p_[:, :-1], draft[..., None].astype(mx.int32), axis=-1)[..., 0] > 0)
        num = mx.cumprod(ok.astype(mx.int32), axis=1).sum(axis=1)
        row = mx.take_along_axis(p_, num[:, None, None], axis=1)[:, 0]
        return num.astype(mx.int32), mx.random.categorical(mx.log(row), key=key).astype(mx.int32)

    monkeypatch.setattr(sp, "rejection_sample", accept_all)
    wrong = sample()
    assert chi2_pvalue(wrong, exact) < 1e-4, (wrong, exact * n)


def test_rows_along_a_draft_are_the_grammar_after_each_prefix(engine) -> None:
    """allowed_along: row i is a fresh matcher's mask after the first i drafts; past a refused draft the rows
    repeat; the matcher ends where it began."""
    from mlx_engine.structured import constrain

    fmt = ResponseFormat("regex", pattern=PATTERN)
    c = constrain(engine.tokenizer, engine.info.vocab_size, fmt)
    draft = [97, 98, 45, 49, 122, 50]  # "ab-1", then "z": refused
    rows = c.allowed_along(draft)
    assert rows.shape == (7, engine.info.vocab_size)
    for i in range(5):
        fresh = constrain(engine.tokenizer, engine.info.vocab_size, fmt)
        for t in draft[:i]:
            fresh.consume(t)
        assert (rows[i] == fresh.allowed()).all(), i
    assert not rows[4][122] and (rows[5] == rows[4]).all() and (rows[6] == rows[4]).all()
    assert (c.allowed() == rows[0]).all()  # rolled back


@pytest.mark.parametrize(("fmt", "match"), [
    (lambda: ResponseFormat("regex", pattern="[a-"), r"response format regex: the regex cannot be used: .*unclosed"),
    (lambda: ResponseFormat("json_schema", schema={"type": "colour"}),
     "response format json_schema: the JSON Schema cannot be used: .*colour"),
    (lambda: ResponseFormat("lark", grammar="start: missing_rule"), "the Lark grammar cannot be used: .*missing_rule"),
    # compiles, but admits no text: was a failed generation quoting the parser's state
    (lambda: ResponseFormat("json_schema", schema={"$ref": "#"}), r"the JSON Schema cannot be used: it admits no text"),
    (lambda: ResponseFormat("lark", grammar="start: start"), "the Lark grammar cannot be used: it admits no text"),
])
def test_a_format_that_does_not_compile_is_refused_at_generate(engine, fmt, match: str) -> None:
    with pytest.raises(RequestError, match=match) as e:
        engine.generate(GenerationRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(response_format=fmt())))
    assert "\n" not in str(e.value) and len(str(e.value)) < 300
    with pytest.raises(RequestError, match=match):  # the same words before a model loads (the CLI's check)
        check_format(fmt())
    assert run(engine, None, max_tokens=3, ignore_eos=True)[0]  # the engine still serves


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"type": "xml"}, "invalid response format type 'xml'"),
    ({"type": "json_schema"}, "takes 'schema' and nothing else"),
    ({"type": "json_object", "pattern": "a"}, "takes no schema, pattern or grammar"),
    ({"type": "json_schema", "schema": "{}"}, "needs a JSON Schema object"),
    ({"type": "regex", "pattern": 5}, "needs 'pattern' as a string"),
])
def test_malformed_response_format_is_a_request_error(kwargs: dict, match: str) -> None:
    with pytest.raises(RequestError, match=match):
        ResponseFormat(**kwargs)


def test_model_without_tokenizer_refuses_a_format(tmp_path: Path) -> None:
    with Engine.load(str(random_llama_folder(tmp_path / "m"))) as e:
        with pytest.raises(RequestError, match="has no tokenizer, which a response format needs"):
            e.generate(GenerationRequest(prompt_token_ids=[3, 4],
                                         sampling=SamplingParams(response_format=ResponseFormat("json_object"))))


def test_json_whitespace_is_bounded() -> None:
    """Between JSON tokens at most a space, or a newline and 20 spaces of indent: a small model cannot pad a reply
    with blank lines until max_tokens."""
    g = grammar(ResponseFormat("json_object"))
    assert "\\x0A[\\x20\\x09]{0,20}" in g or "{0,20}" in g
    assert not LLMatcher.validate_grammar(g)


def test_torch_backend_gives_the_same_constrained_reply(tiny: Path, engine) -> None:
    from tests.support.torch_support import require

    require()
    fmt = ResponseFormat("json_schema", schema=SCHEMA)
    with Engine.load(str(tiny), backend="torch", device="cpu") as t:
        for kw in ({}, {"temperature": 1.0, "seed": 2}):
            assert run(t, fmt, max_tokens=60, **kw)[1] == run(engine, fmt, max_tokens=60, **kw)[1]


def test_smollm2_json_schema_chat_reply() -> None:
    """The embedded model, asked in chat for a person as JSON: a reply that parses and has the schema's keys."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    with Engine.load(None) as e:
        events = list(e.generate(GenerationRequest(
            messages=[{"role": "user", "content": "Describe a fictional person as JSON with a name and an age."}],
            sampling=SamplingParams(temperature=0.0, max_tokens=40,
                                    response_format=ResponseFormat("json_schema", schema=schema)))))
    text = "".join(ev.text for ev in events)
    assert events[-1].finish_reason == "stop", text
    value = json.loads(text)
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and isinstance(value["age"], int)
