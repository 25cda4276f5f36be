"""The CLI as a user runs it: real subprocesses, exit codes, one clear line on stderr for a mistake."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.support.cli import assert_one_line_error, roofline
from tests.support.tiny_models import GOLDEN


def test_no_arguments_prints_help() -> None:
    r = roofline()
    assert r.returncode == 0 and "generate" in r.stdout and "tokens" in r.stdout


def test_a_typo_is_one_line_with_a_did_you_mean() -> None:
    """Not the 12-line usage: the mistake, the nearest command, choice or option, and where the help is."""
    assert_one_line_error(roofline("genrate", "-p", "x"), "unknown command 'genrate'", "did you mean generate?",
                          "roofline --help")
    assert_one_line_error(roofline("generate", "-p", "x", "--seed", "abc"), "--seed 'abc': expected an integer",
                          "roofline generate --help")
    assert_one_line_error(roofline("generate", "-p", "x", "--tmep", "0.5"), "unknown option --tmep",
                          "did you mean --temp?")
    assert_one_line_error(roofline("bench", "--backend", "trch"), "--backend 'trch': expected one of auto, mlx, torch",
                          "did you mean torch?")
    assert_one_line_error(roofline("generate"), "roofline generate needs --prompt/-p")


def test_a_bad_regex_or_draft_model_fails_before_the_model_loads(tmp_path: Path, monkeypatch, capsys) -> None:
    """Checked first: a load of the embedded model alone takes 6-7 s here."""
    import mlx_engine
    from app import cli

    monkeypatch.setattr(mlx_engine.Engine, "load", lambda *a, **k: pytest.fail("the model was loaded first"))
    (tmp_path / "colour.json").write_text('{"type": "colour"}')
    for args, needles in ((("--regex", "(yes|no"), ("the regex cannot be used", "unclosed group")),
                          (("--json-schema", str(tmp_path / "colour.json")), ("the JSON Schema cannot", "colour")),
                          (("--draft-model", "/nowhere/draft.gguf"), ("--draft-model: model not found",))):
        assert cli.main(["generate", "-p", "x", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("roofline: error: ") and len(err.strip().splitlines()) == 1
        assert all(n in err for n in needles), err


def test_generate_json_on_embedded_model_answers_paris() -> None:
    # MLX's greedy answer: torch's CPU path (activations rounded to int8) begins "L'Étoile" here
    r = roofline("generate", "-p", "What is the capital of France?", "--max-tokens", "8", "--json", "--backend", "mlx")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "Paris" in out["text"]
    assert out["usage"]["completion_tokens"] <= 8 and out["stats"]["decode_tps"] > 0
    assert out["backend"] == "mlx" and out["device"] in ("cpu", "metal")


def test_generate_stats_line_says_where_the_model_ran() -> None:
    r = roofline("generate", "-p", "Hi", "--max-tokens", "2", "--backend", "mlx")
    assert r.returncode == 0, r.stderr
    assert " | MLX on CPU | " in r.stderr or " | MLX on Metal | " in r.stderr, r.stderr


def test_generate_held_to_a_json_schema_and_a_regex(tmp_path: Path) -> None:
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                                   "age": {"type": "integer"}},
                                  "required": ["name", "age"], "additionalProperties": False}))
    r = roofline("generate", "-p", "Make up a person.", "--json-schema", str(schema), "-n", "40", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["finish_reason"] == "stop" and set(json.loads(out["text"])) == {"name", "age"}
    r = roofline("generate", "-p", "Is water wet? Answer yes or no.", "--regex", "(yes|no)", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["text"] in ("yes", "no")


def test_generate_cut_by_max_tokens_inside_a_character_ends_on_a_whole_one() -> None:
    """🎉 is three of SmolLM2's tokens (<0xF0><0x9F>, <0x8E>, <0x89>): one token of it is no character, so the
    reply's text is empty, not U+FFFD; four tokens are the emoji and half of the next."""
    r = roofline("generate", "-p", "Reply with a party emoji.", "--regex", "🎉🎉", "-n", "1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["text"], out["finish_reason"], out["usage"]["completion_tokens"]) == ("", "length", 1)
    r = roofline("generate", "-p", "Reply with a party emoji.", "--regex", "🎉🎉", "-n", "4", "--json")
    assert json.loads(r.stdout)["text"] == "🎉"


def test_generate_with_a_bad_schema_file_is_one_line(tmp_path: Path) -> None:
    assert_one_line_error(roofline("generate", "-p", "x", "--json-schema", str(tmp_path / "none.json")),
                          "none.json: cannot read it")
    (tmp_path / "bad.json").write_text("{not json")
    assert_one_line_error(roofline("generate", "-p", "x", "--json-schema", str(tmp_path / "bad.json")),
                          "bad.json: not valid JSON")
    (tmp_path / "colour.json").write_text('{"type": "colour"}')
    assert_one_line_error(roofline("generate", "-p", "x", "--json-schema", str(tmp_path / "colour.json")),
                          "the JSON Schema cannot be used: Invalid type: colour")


def test_generate_with_a_chat_template_of_ones_own(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}Q: {{ m.content }}\n{% endfor %}A:")
    r = roofline("generate", "-p", "Hi", "-n", "2", "--chat-template", str(template), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["usage"]["prompt_tokens"] == 6  # "Q: Hi\nA:" is 6 of SmolLM2's tokens
    (tmp_path / "bad.jinja").write_text("{% if %}")
    assert_one_line_error(roofline("generate", "-p", "x", "--chat-template", str(tmp_path / "bad.jinja")),
                          "chat template", "bad.jinja: it has a syntax error")


def test_logits_writes_golden_logits(tmp_path: Path) -> None:
    golden = np.load(GOLDEN / "llama" / "golden.npz")
    ids = golden["input_ids"].ravel().tolist()
    out = tmp_path / "out.npy"
    r = roofline("logits", "--model", str(GOLDEN / "llama"), "--token-ids", ",".join(map(str, ids)), "-o", str(out))
    assert r.returncode == 0, r.stderr
    got = np.load(out)
    assert got.dtype == np.float32 and got.shape == (len(ids), 128)
    assert float(np.abs(got - golden["logits"].reshape(got.shape)).max()) <= 1e-4


def test_tokens_json_on_gguf_vocabulary() -> None:
    r = roofline("tokens", "--json", "Hello world")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"ids": [19556, 905]}


def test_missing_model_is_one_clear_line(tmp_path: Path) -> None:
    r = roofline("generate", "--model", str(tmp_path / "missing.gguf"), "-p", "hi")
    assert_one_line_error(r, "model not found", "missing.gguf")


def test_bad_sampling_value_is_one_clear_line() -> None:
    r = roofline("generate", "-p", "hi", "--temp", "-1")
    assert_one_line_error(r, "temperature=-1.0", "expected a number >= 0")


def test_bad_token_ids_is_one_clear_line(tmp_path: Path) -> None:
    r = roofline("logits", "--model", str(GOLDEN / "llama"), "--token-ids", "1,x", "-o", str(tmp_path / "a.npy"))
    assert_one_line_error(r, "--token-ids", "comma-separated integers")


def test_prompt_too_long_is_one_clear_line(tmp_path: Path) -> None:
    ids = ",".join(["5"] * 300)
    r = roofline("logits", "--model", str(GOLDEN / "llama"), "--token-ids", ids, "-o", str(tmp_path / "a.npy"))
    assert_one_line_error(r, "300 tokens", "context is 256 tokens")


def test_generate_on_a_model_without_a_tokenizer_says_so_in_one_line() -> None:
    """The tiny golden llama has weights and config only: generate says what is missing and what works instead,
    not the API's "send prompt_token_ids"."""
    r = roofline("generate", "--model", str(GOLDEN / "llama"), "-p", "hi", "-n", "2")
    assert_one_line_error(r, "llama came without a tokenizer", "tokenizer.json", "roofline logits --token-ids")
    assert "prompt_token_ids" not in r.stderr


def test_tokens_on_vocabulary_only_gguf(tmp_path: Path) -> None:
    import gguf

    from tests.support.tiny_models import byte_level_vocab

    path = tmp_path / "vocab.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(byte_level_vocab(256) + ["he", "ll", "hell", "hello"])
    w.add_token_types([1] * 260)
    w.add_token_merges(["h e", "l l", "he ll", "hell o"])
    w.add_eos_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = roofline("tokens", "-t", str(path), "--json", "hello hell")
    assert r.returncode == 0, r.stderr
    # "hello" merges to one token; " hell" is a space (byte 0x20 -> 'Ġ' at id 32) then "hell"
    assert json.loads(r.stdout) == {"ids": [259, 32, 258]}
    r = roofline("tokens", "-t", str(path), "hello")
    assert "'hello'" in r.stdout and r.returncode == 0


def test_tokens_on_missing_tokenizer_is_one_clear_line(tmp_path: Path) -> None:
    assert_one_line_error(roofline("tokens", "-t", str(tmp_path / "nope.gguf"), "hi"), "model not found")


def test_kv_sizes_llama3_70b_from_config_alone(tmp_path: Path) -> None:
    """No weights needed: Llama-3-70B's config gives 32.8 GB for 100K tokens in fp16."""
    config = {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
              "num_key_value_heads": 8, "max_position_embeddings": 8192, "vocab_size": 128256}
    (tmp_path / "config.json").write_text(json.dumps(config))
    r = roofline("kv", "--model", str(tmp_path), "--context", "100000", "--dtype", "float16")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("32.8 GB (32,768,000,000 bytes) of KV for 1 x 100,000 tokens in float16")
    assert "327,680 bytes per token" in r.stdout


def test_kv_on_embedded_gguf_with_quantized_kv() -> None:
    r = roofline("kv", "--context", "8192", "--batch", "4", "--kv-bits", "8", "--dtype", "float16")
    # 30 layers x 3 KV heads x (64 bytes + 2 x 2 bytes of scale and bias per group of 64) x 2 (K, V)
    assert r.returncode == 0 and "(401,080,320 bytes) of KV for 4 x 8,192 tokens in 8-bit" in r.stdout
    assert "12,240 bytes per token" in r.stdout


def test_kv_defaults_to_what_this_machines_engine_stores_and_says_so(capsys) -> None:
    """No --dtype: the bytes per token the engine itself allocates here (float32 on MLX's CPU backend, float32
    scales for quantized KV), and the dtype named."""
    from app.cli import main
    from mlx_engine import Engine
    from mlx_engine.roofline import kv_dtype_here

    dtype, why = kv_dtype_here()
    for extra, kv_bits in (((), None), (("--kv-bits", "8"), 8)):
        assert main(["kv", "--context", "4096", *extra]) == 0
        line = capsys.readouterr().out
        assert f"{dtype}" in line and why in line
        per_token = int(line.split(" bytes per token")[0].rsplit(", ", 1)[1].replace(",", ""))
        with Engine.load(None, backend="mlx", **({"kv_bits": kv_bits} if kv_bits else {})) as e:
            stats = e.kv_stats()
            assert per_token == stats["bytes_per_block"] // stats["block_size"], (line, stats)


def test_kv_bad_model_is_one_clear_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert_one_line_error(roofline("kv", "--model", str(tmp_path), "--context", "10"), "config.json",
                          "num_attention_heads")


def test_kv_with_8bit_keys_and_4bit_values() -> None:
    r = roofline("kv", "--context", "8192", "--batch", "4", "--kv-bits", "4", "--kv-key-bits", "8", "--dtype",
                 "float16")
    # 30 layers x 3 KV heads x (K: 64 + 4 bytes, V: 32 + 4 bytes of packed values, scale and bias per group)
    assert r.returncode == 0, r.stderr
    assert "(306,708,480 bytes) of KV for 4 x 8,192 tokens in 8-bit keys, 4-bit values" in r.stdout
    assert "9,360 bytes per token" in r.stdout
    assert_one_line_error(roofline("kv", "--context", "10", "--kv-key-bits", "8"), "--kv-key-bits 8 needs --kv-bits")


def test_kv_at_4_bits_counts_keys_per_channel() -> None:
    """4-bit keys are grouped per channel over each block (the engine's default): a scale and a bias per channel
    and block of 16 tokens."""
    r = roofline("kv", "--context", "8192", "--kv-bits", "4", "--dtype", "float16")
    # 30 layers x 3 KV heads x (K: 32 + 2 x 2 bytes x 64 / 16, V: 32 + 4 bytes of packed values, scale and bias)
    assert r.returncode == 0, r.stderr
    assert "(8,192 x 7,560 bytes" not in r.stdout and "7,560 bytes per token" in r.stdout
    assert "4-bit (g64, keys per channel over 16-token blocks, float16 scales)" in r.stdout
    r = roofline("kv", "--context", "8192", "--kv-bits", "4", "--block-size", "32", "--dtype", "float16")
    assert r.returncode == 0 and "6,840 bytes per token" in r.stdout  # K: 32 + 2 x 2 x 64 / 32


def test_generate_with_quantized_kv_options() -> None:
    """8-bit KV stays faithful (the same answer); 4-bit runs (on a 135M model its replies drift:
    docs/benchmarks/kv-cache.md, figure 4's chat check). A bad value is one clear line."""
    r = roofline("generate", "-p", "What is the capital of France?", "--max-tokens", "8", "--json", "--kv-bits", "8",
                 "--block-size", "32")
    assert r.returncode == 0, r.stderr
    assert "Paris" in json.loads(r.stdout)["text"]
    r = roofline("generate", "-p", "What is the capital of France?", "--max-tokens", "8", "--json", "--kv-bits", "4")
    assert r.returncode == 0 and json.loads(r.stdout)["usage"]["completion_tokens"] >= 1, r.stderr
    r = roofline("generate", "-p", "hi", "--kv-bits", "3")
    assert r.returncode == 2 and "--kv-bits: invalid choice: 3" in r.stderr and "Traceback" not in r.stderr


def test_a_models_warnings_go_to_stderr_before_the_reply(monkeypatch, capsys) -> None:
    """`roofline generate` (and serve, through the same loader) prints ModelInfo.warnings as warning lines."""
    import dataclasses

    from app import cli
    from mlx_engine import Engine

    load = Engine.load

    def warned(*a, **k):
        engine = load(*a, **k)
        engine.info = dataclasses.replace(engine.info, warnings=("mind the gap",))
        return engine

    monkeypatch.setattr(Engine, "load", warned)
    assert cli.main(["generate", "-p", "Hi", "-n", "1", "--temp", "0"]) == 0
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "roofline: warning: mind the gap"


def test_generate_with_a_draft_model_is_greedy_exact_and_reports_its_drafts(capsys) -> None:
    """--draft-model beside the embedded model (itself: every draft passes at temperature 0): the reply equals
    plain decoding's, and the stats carry the drafts."""
    from app import cli
    from mlx_engine.loading import embedded_model_path

    args = ["generate", "-p", "Repeat exactly: the quick brown fox jumps over the lazy dog.", "-n", "12", "--json"]
    assert cli.main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["stats"]["acceptance_rate"] is None and plain["stats"]["target_forwards"] >= 12
    assert cli.main([*args, "--draft-model", str(embedded_model_path()), "--speculative", "draft",
                     "--num-draft-tokens", "3"]) == 0
    drafted = json.loads(capsys.readouterr().out)
    assert drafted["text"] == plain["text"] and drafted["usage"] == plain["usage"]
    stats = drafted["stats"]
    assert stats["acceptance_rate"] == 1.0 and 1.0 <= stats["mean_accepted_tokens"] <= 3.0
    assert stats["target_forwards"] < plain["stats"]["target_forwards"]


def test_draft_flags_without_a_draft_model_are_one_clear_line(monkeypatch, capsys) -> None:
    """Refused before any model loads, in generate and serve alike; chat loads its draft as optional."""
    import app.server as server_pkg
    import app.tui as tui_pkg
    from app import cli

    for command in (["generate", "-p", "hi"], ["serve"]):
        assert cli.main([*command, "--speculative", "draft"]) == 2
        assert capsys.readouterr().err.strip() == (
            "roofline: error: --speculative draft needs --draft-model MODEL: a small model with the model's "
            "tokenizer (or use prompt-lookup or self, which need no other model)")
        assert cli.main([*command, "--draft-bits", "4"]) == 2
        assert "--draft-bits 4 needs --draft-model MODEL" in capsys.readouterr().err
    assert cli.main(["generate", "-p", "hi", "--speculative", "prompt-lookup", "--num-draft-tokens", "17"]) == 2
    assert capsys.readouterr().err.strip() == (
        "roofline: error: invalid sampling parameter num_draft_tokens=17: expected an integer in [1, 16]")
    seen: dict = {}
    monkeypatch.setattr(server_pkg, "serve", lambda factory, **kw: seen.update(kw) or 0)
    small = str(GOLDEN / "llama")  # a draft model must exist: it is looked up before anything loads
    assert cli.main(["serve", "--draft-model", small]) == 0 and seen["speculative"] == "auto"
    assert cli.main(["serve", "--draft-model", small, "--speculative", "off"]) == 0
    assert seen["speculative"] is None
    monkeypatch.setattr(tui_pkg, "run", lambda model, **options: seen.update(chat=(model, options)) or 0)
    assert cli.main(["chat", "-m", "big.gguf", "--draft-model", small, "--draft-bits", "8"]) == 0
    assert seen["chat"] == ("big.gguf", {"draft_model": small, "draft_bits": 8, "draft_optional": True})


def test_serve_max_concurrency_is_the_engine_s_batch(monkeypatch) -> None:
    """--max-concurrency requests run at once, so the engine is loaded to batch that many (Engine.load's
    max_seqs): 64 running requests were 16 decoding and 48 waiting in the scheduler."""
    import app.server as server_pkg
    from app import cli, serve_cmd

    loaded: dict = {}
    monkeypatch.setattr(serve_cmd, "load_engine", lambda model, **options: loaded.update(options) or "engine")

    def serve(factory, **kw) -> int:
        assert factory() == "engine"
        return 0

    monkeypatch.setattr(server_pkg, "serve", serve)
    assert cli.main(["serve", "-m", "embedded", "--max-concurrency", "64"]) == 0
    assert loaded["max_seqs"] == 64
    assert cli.main(["serve", "-m", "embedded"]) == 0 and loaded["max_seqs"] == 16
