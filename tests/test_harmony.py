"""gpt-oss's harmony format (mlx_engine/harmony.py): the vocabulary file written from the checkpoint's tokenizer and
nothing fetched; openai-harmony's parser driven with scripted token ids (analysis -> reasoning, final -> answer,
commentary to a function -> a tool call, characters split across tokens, the budget's forced header); the engine on
a tiny gpt-oss with the real o200k_harmony tokenizer."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_engine.api import GenerationRequest, SamplingParams, ToolCall
from mlx_engine.harmony import (CHANNEL, MESSAGE, VOCAB_FILE, VOCAB_SHA256, HarmonyFormat, harmony_format,
                                write_vocab)
from mlx_engine.reasoning import HARMONY, reasoning_family, template_kwargs
from mlx_engine.tokenizer import Tokenizer
from tests.support.harmony_models import harmony_model_folder, harmony_tokenizer_files

OFFLINE = {"HF_HUB_OFFLINE": "1", "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
           "ALL_PROXY": "http://127.0.0.1:9", "TIKTOKEN_RS_CACHE_DIR": "/nonexistent"}
REPLY = ("<|channel|>analysis<|message|>Let me think: 2+2=4.<|end|><|start|>assistant<|channel|>final<|message|>"
         "Four!<|return|>")
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>'


@pytest.fixture(scope="module")
def tok(tmp_path_factory, cache) -> Tokenizer:
    return Tokenizer.from_folder(harmony_tokenizer_files(tmp_path_factory.mktemp("harmony") / "tok"))


@pytest.fixture(scope="module")
def fmt(tok) -> HarmonyFormat:
    found = harmony_format(tok)
    assert found is not None
    return found


def run(fmt: HarmonyFormat, tok: Tokenizer, text: str, budget: int | None = None):
    ids = fmt.encoding.encode(text, allowed_special="all")
    p = fmt.parser([], budget)
    events = [p.feed(i, tok.decode([i])) for i in ids[:-1]]  # the last is EOS: the scheduler never feeds it
    events.append(p.flush(""))
    return p, events


def test_the_vocab_file_is_written_from_the_tokenizer(tok, fmt, cache) -> None:
    path = cache / "harmony" / VOCAB_FILE
    assert hashlib.sha256(path.read_bytes()).hexdigest() == VOCAB_SHA256
    assert reasoning_family(tok) == HARMONY


def test_nothing_is_fetched(tok, tmp_path) -> None:
    # a fresh process, an empty cache dir, every proxy a dead port: openai-harmony reads the file written here
    folder = harmony_tokenizer_files(tmp_path / "tok")
    code = ("from mlx_engine.tokenizer import Tokenizer; from mlx_engine.reasoning import reasoning_family; "
            f"print(reasoning_family(Tokenizer.from_folder({str(folder)!r})))")
    env = {**os.environ, **OFFLINE, "ROOFLINE_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == HARMONY, out.stderr
    assert (tmp_path / "cache" / "harmony" / VOCAB_FILE).is_file()


def test_without_the_file_openai_harmony_would_download(tmp_path) -> None:
    code = ("from openai_harmony import load_harmony_encoding as l, HarmonyEncodingName as n\n"
            "try: l(n.HARMONY_GPT_OSS)\nexcept Exception as e: print(e)")
    env = {k: v for k, v in os.environ.items() if k != "TIKTOKEN_ENCODINGS_BASE"}
    out = subprocess.run([sys.executable, "-c", code], env={**env, **OFFLINE}, capture_output=True, text=True,
                         timeout=120)
    assert "error downloading or loading vocab file" in out.stdout


def test_analysis_is_reasoning_and_final_the_answer(fmt, tok) -> None:
    p, events = run(fmt, tok, REPLY)
    assert "".join(r for r, _ in events) == "Let me think: 2+2=4."
    assert "".join(a for _, a in events) == "Four!"
    # reasoning: <|channel|>analysis<|message|>, 11 content tokens, <|end|>
    assert (p.num_tokens, p.num_thinking, p.tool_calls) == (15, 11, ())
    assert p.answering and p.answer_token


def test_markup_gives_no_text(fmt, tok) -> None:
    _, events = run(fmt, tok, REPLY)
    ids = fmt.encoding.encode(REPLY, allowed_special="all")
    markup = [e for e, i in zip(events, ids) if fmt.encoding.is_special_token(i)]
    assert markup and all(e == ("", "") for e in markup)


def test_a_character_split_across_tokens_arrives_whole(fmt, tok) -> None:
    ch = next(c for c in "𝔘𓀀𐍈🝖" if len(fmt.encoding.encode(c)) > 1)
    p, events = run(fmt, tok, f"<|channel|>final<|message|>{ch}{ch}<|return|>")
    answers = [a for _, a in events if a]
    assert "".join(answers) == ch + ch and all("\ufffd" not in a for a in answers)


def test_commentary_to_a_function_is_a_tool_call(fmt, tok) -> None:
    p, events = run(fmt, tok, "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant" + CALL)
    assert "".join(r for r, _ in events) == "Need weather."
    assert "".join(a for _, a in events) == ""
    assert p.tool_calls == (ToolCall(name="get_weather", arguments='{"city":"Paris"}'),)


def test_a_preamble_to_the_user_is_answer_text(fmt, tok) -> None:
    _, events = run(fmt, tok, "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant" + CALL)
    assert "".join(a for _, a in events) == "Checking."


def test_a_reply_that_is_not_harmony_is_shown_as_it_is(fmt, tok) -> None:
    p = fmt.parser([], None)
    ids = fmt.encoding.encode("<|channel|>final<|message|>a<|end|>hi there", allowed_special="all")
    out = [p.feed(i, tok.decode([i])) for i in ids]  # text where a <|start|> must come: openai-harmony refuses it
    assert "".join(a for _, a in out) == "ahi there" and p.answering and not p.budgeted


@pytest.mark.parametrize("budget", [0, 3])
def test_the_budget_forces_the_final_header(fmt, tok, budget) -> None:
    vocab = tok.vocab_size
    p = fmt.parser([], budget)
    closer = fmt.encoding.encode("<|end|><|start|>assistant<|channel|>final<|message|>", allowed_special="all")
    head = fmt.encoding.encode("<|channel|>analysis<|message|>Let me think it over", allowed_special="all")
    written: list[int] = []
    for i in head:
        m = p.mask(None, vocab)
        if m is not None:
            break
        p.feed(i, "")
        written.append(i)
    while (m := p.mask(None, vocab)) is not None:
        (forced,) = m.nonzero()[0]
        p.feed(int(forced), "")
        written.append(int(forced))
    if budget == 0:
        assert written == [CHANNEL, *fmt.final, MESSAGE]
    else:
        assert written == head[:3 + budget] + closer and p.num_thinking == budget
    assert p.answering and not p.budgeted and p.mask(None, vocab) is None


def test_effort_becomes_the_reasoning_line(tok) -> None:
    assert template_kwargs(HARMONY, None, "minimal") == {"reasoning_effort": "low"}
    assert template_kwargs(HARMONY, None, "high") == {"reasoning_effort": "high"}
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}], **template_kwargs(HARMONY, None, "none"))
    assert "Reasoning: low\n" in tok.decode(ids)


def test_a_tokenizer_that_is_not_o200k_is_not_harmony(tok) -> None:
    from tokenizers import Tokenizer as HF
    from tokenizers import models

    small = Tokenizer(HF(models.BPE(vocab={chr(65 + i): i for i in range(26)}, merges=[])), chat_template="<|channel|>")
    assert reasoning_family(small) is None  # no harmony markup among its tokens

    class Other:  # harmony's markup, another vocabulary
        backend = type("B", (), {"get_vocab": lambda self, with_added_tokens: {"A": 0}})()

    with pytest.raises(ValueError, match="has 1 base tokens"):
        write_vocab(Other(), Path("/nonexistent"))


@pytest.fixture(scope="module")
def engine(tmp_path_factory, cache):
    from mlx_engine import Engine

    e = Engine.load(str(harmony_model_folder(tmp_path_factory.mktemp("gptoss") / "m")))
    yield e
    e.close()


def test_the_engine_reads_gpt_oss_as_harmony(engine, fmt) -> None:
    assert engine.info.reasoning == HARMONY
    req = GenerationRequest(messages=[{"role": "user", "content": "Hi"}],
                            sampling=SamplingParams(max_tokens=8, temperature=0.0, reasoning_budget=0))
    events = list(engine.generate(req))
    ids = [t for e in events for t in e.token_ids]
    assert ids[:3] == [CHANNEL, *fmt.final, MESSAGE]  # no room to think: the final header, forced
    assert "".join(e.reasoning for e in events) == "" and events[-1].usage.reasoning_tokens == 0


def test_a_harmony_template_on_another_vocabulary_is_a_warning(tok) -> None:
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HF
    from tokenizers import models

    from mlx_engine.harmony import MARKERS, harmony_warning

    letters = {chr(65 + i): i for i in range(26)}

    def tokenizer(vocab: dict[str, int], template: str = "<|start|>user<|channel|>") -> Tokenizer:
        hf = HF(models.BPE(vocab=vocab, merges=[]))
        hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in MARKERS])
        return Tokenizer(hf, chat_template=template)

    at_its_ids = tokenizer({**letters, **MARKERS})  # the markup where o200k_harmony has it, 26 tokens before it
    assert reasoning_family(at_its_ids) is None
    assert "(its vocabulary has 26 base tokens, o200k has 199998)" in harmony_warning(at_its_ids)
    moved = harmony_warning(tokenizer(letters))
    assert "its markup tokens are not at o200k_harmony's ids: <|start|> is 26, not 200006" in moved
    assert harmony_warning(tokenizer({**letters, **MARKERS}, "{{ messages }}")) is None  # no harmony template
    assert harmony_warning(Tokenizer(HF(models.BPE(vocab=letters, merges=[])), chat_template="<|channel|>")) is None
    assert harmony_warning(tok) is None
