"""The paged KV cache's five figures (issue 5), each side by side in one run.

    uv run python bench/kv.py [--quick] [--only 1,2,3,4,5] [--repeats 3]

1. KV memory waste (allocated but unused / allocated) of 32 concurrent sequences of mixed lengths:
   our block tables (pure bookkeeping, `KVCacheManager`) against mlx-lm's `KVCache` fed the same
   sequences the way `generate_step` feeds it (prefill in 2048-token steps, then one token a step).
2. Time to first token of a chat's next turn with the prefix cache against a full re-prefill
   (`prefix_caching=False`), at 512, 1K and 2K tokens of history.
3. Eight requests sharing a 1K-token system prompt: prompt tokens computed against naive.
4. 8-bit and 4-bit KV (group size 64 and 32), and 8-bit keys with 4-bit values (`kv_key_bits`): bytes
   per token against fp16, and the perplexity change on public-domain English text (`bench/data/`)
   through `Engine.score` (quantized K/V smoothed as the engine stores them: `mlx_engine/kv/smoothing.py`).
5. Decode tokens/s with paged against contiguous KV at 1K and 4K of context, runs alternating.

Prints a markdown section for docs/benchmarks/kv-cache.md on stdout, progress on stderr. The embedded SmolLM2
by default. `--quick` shrinks every figure to a smoke test (its numbers are not the reported ones).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlx_engine import Engine, GenerationRequest, SamplingParams  # noqa: E402
from mlx_engine.catalog import kv_shape  # noqa: E402
from mlx_engine.memory import kv_bytes  # noqa: E402
from mlx_engine.kv import BlockPool, KVCacheManager  # noqa: E402

TEXT = Path(__file__).resolve().parent / "data" / "founding_documents.txt"
MLX_LM_PREFILL_STEP = 2048  # mlx_lm.generate.generate_step's default prefill_step_size


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(engine: Engine, n: int, *, ids: list[int] | None = None, messages: list[dict] | None = None,
        ignore_eos: bool = True):
    """One greedy request -> (final event, generated text)."""
    req = GenerationRequest(prompt_token_ids=ids, messages=messages,
                            sampling=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=ignore_eos))
    text, final = [], None
    for final in engine.generate(req):
        text.append(final.text)
    if final is None or final.finish_reason == "error":
        raise RuntimeError(f"generation failed: {final and final.error}")
    return final, "".join(text)


def document_ids(engine: Engine) -> list[int]:
    body = TEXT.read_text().split("\n", 1)[1]  # drop the source line
    return engine.tokenizer.encode(body, add_special_tokens=False)


def fmt_s(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.2f} s"


# ---- 1. memory waste --------------------------------------------------------------------------------

def mixed_sequences(n: int, lo: int, hi: int, seed: int) -> list[tuple[int, int]]:
    """(prompt tokens, generated tokens) of n sequences: total uniform in [lo, hi], 50-95% of it prompt."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        total = int(rng.integers(lo, hi + 1))
        prompt = max(1, min(total, round(total * rng.uniform(0.5, 0.95))))
        out.append((prompt, total - prompt))
    return out


def ours_slots(seqs: list[tuple[int, int]], block_size: int, chunk: int) -> list[int]:
    """KV slots each sequence's block table holds after prefill in `chunk`-token steps and one-token decode."""
    num_blocks = sum(math.ceil((p + g) / block_size) for p, g in seqs)
    mgr = KVCacheManager(BlockPool(num_blocks), block_size)
    rng = np.random.default_rng(1)
    for i, (p, g) in enumerate(seqs):
        # random ids: no two sequences share a prefix, so no block is shared (sharing only lowers ours)
        ids = rng.integers(0, 49152, p + g).tolist()
        for start in range(0, p, chunk):
            assert mgr.allocate_slots(f"s{i}", ids, min(chunk, p - start)) is not None
        for _ in range(g):
            assert mgr.allocate_slots(f"s{i}", ids, 1) is not None
    for i, (p, g) in enumerate(seqs):
        assert mgr.num_tokens(f"s{i}") == p + g
    return [len(mgr.block_table(f"s{i}")) * block_size for i in range(len(seqs))]


def mlx_lm_slots(seqs: list[tuple[int, int]], num_kv_heads: int, head_dim: int) -> list[int]:
    """Token slots of one layer's mlx-lm KVCache per sequence, fed as generate_step feeds it: the prompt
    but its last token in 2048-token steps, then the last prompt token, then one token per decode step."""
    from mlx_lm.models.cache import KVCache

    out = []
    for p, g in seqs:
        cache = KVCache()
        steps = []
        rest = p - 1
        while rest > 0:
            steps.append(min(MLX_LM_PREFILL_STEP, rest))
            rest -= steps[-1]
        steps += [1] * (1 + g)
        for n in steps:
            x = mx.zeros((1, num_kv_heads, n, head_dim), mx.float16)  # (B, Hkv, L, D)
            cache.update_and_fetch(x, x)
        mx.eval(cache.keys, cache.values)
        assert cache.offset == p + g
        out.append(int(cache.keys.shape[2]))
    return out


def figure_waste(args, shape) -> list[str]:
    seqs = mixed_sequences(32, 50, 4000, seed=0)
    tokens = [p + g for p, g in seqs]
    per_token = kv_bytes(shape, 1, itemsize=2)  # fp16 K and V of every layer
    rows = []
    for name, slots in ((f"Roofline paged, block size {args.block_size}",
                         ours_slots(seqs, args.block_size, 512)),
                        (f"mlx-lm {__import__('mlx_lm').__version__} `KVCache` (step 256)",
                         mlx_lm_slots(seqs, shape.num_kv_heads, shape.head_dim))):
        alloc, used = sum(slots), sum(tokens)
        rows.append(f"| {name} | {used:,} | {alloc:,} | {alloc * per_token / 2**20:,.0f} MiB | "
                    f"{(alloc - used) * per_token / 2**20:,.1f} MiB | {100 * (alloc - used) / alloc:.2f}% |")
    return [
        f"**1. KV memory waste**, 32 concurrent sequences, lengths uniform in 50..4000 tokens (seed 0; "
        f"{sum(tokens):,} tokens, 50-95% of each prompt, the rest decoded one token a step; ours prefills in "
        f"512-token chunks, mlx-lm in its 2048-token steps). Bytes for SmolLM2-135M's KV shape "
        f"({shape.num_layers} layers x {shape.num_kv_heads} KV heads x {shape.head_dim}) in fp16, "
        f"{per_token:,} bytes a token:",
        "",
        "| KV cache | tokens held | slots allocated | allocated | unused | waste (unused / allocated) |",
        "|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
    ]


# ---- 2. next-turn TTFT ------------------------------------------------------------------------------

FOLLOW_UPS = [
    "Which grievance in the text concerns trial by jury?",
    "Name two powers the text gives to Congress.",
    "What age must a Senator have reached?",
    "Summarize the last paragraph in one sentence.",
    "Who presides when the President is tried?",
]


def history_messages(engine: Engine, doc: list[int], target: int) -> list[dict]:
    """A system line and one user message quoting the document, `target` template tokens in all."""
    head = [{"role": "system", "content": "You are a careful reader of historical documents."}]
    k = target
    for _ in range(4):  # re-tokenizing the decoded text may shift the count a little: converge
        msgs = head + [{"role": "user", "content": engine.tokenizer.decode(doc[:k]) + "\n\nWhat is this text?"}]
        n = len(engine.tokenizer.encode_chat(msgs, add_generation_prompt=True))
        if n == target:
            break
        k += target - n
    return msgs


def figure_ttft(args, doc: list[int]) -> list[str]:
    cached = Engine.load(args.model, backend="mlx", block_size=args.block_size)
    fresh = Engine.load(args.model, backend="mlx", block_size=args.block_size, prefix_caching=False)
    rows = []
    for target in args.histories:
        history = history_messages(cached, doc, target)
        first, reply = run(cached, 32, messages=history, ignore_eos=False)  # turn 1: prefills the history
        log(f"  history {first.usage.prompt_tokens}: turn 1 ttft {first.stats.ttft_s:.1f} s")
        hot, cold, cached_tokens, prompt_tokens = [], [], [], []
        for r in range(args.repeats):
            turn2 = history + [{"role": "assistant", "content": reply},
                               {"role": "user", "content": FOLLOW_UPS[r % len(FOLLOW_UPS)]}]
            ev, _ = run(cached, 1, messages=turn2)
            hot.append(ev.stats.ttft_s)
            cached_tokens.append(ev.usage.cached_prompt_tokens)
            prompt_tokens.append(ev.usage.prompt_tokens)
            if r < args.cold_repeats:
                ev_cold, _ = run(fresh, 1, messages=turn2)
                assert ev_cold.usage.cached_prompt_tokens == 0
                cold.append(ev_cold.stats.ttft_s)
            log(f"  history {target} turn 2 #{r}: cached {hot[-1]:.2f} s, full {cold[-1] if cold else 0:.2f} s")
        h, c = statistics.median(hot), statistics.median(cold)
        rows.append(f"| {first.usage.prompt_tokens:,} | {fmt_s(first.stats.ttft_s)} | "
                    f"{statistics.median(prompt_tokens):,.0f} | {statistics.median(cached_tokens):,.0f} | "
                    f"{fmt_s(c)} | {fmt_s(h)} | **{c / h:.1f}x** |")
    cached.close()
    fresh.close()
    return [
        f"**2. Time to first token of a chat's next turn**: turn 1 is a system line plus a user message quoting "
        f"`bench/data/` (the history), answered with up to 32 tokens; turn 2 adds that reply and a new question. "
        f"TTFT of turn 2 on the engine that served turn 1 (prefix cache on) against an engine with "
        f"`prefix_caching=False` (a full re-prefill). Medians of {args.repeats} follow-up questions "
        f"({args.cold_repeats} for the full re-prefill):",
        "",
        "| history tokens | turn-1 TTFT | turn-2 prompt tokens | served from cache | TTFT full re-prefill | "
        "TTFT prefix cache | speed-up |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
    ]


# ---- 3. shared system prompt ------------------------------------------------------------------------

QUESTIONS = [
    "What is the first grievance listed?", "When was this declared?", "Who signs on behalf of the colonies?",
    "What does the text say about taxes?", "What is said about standing armies?", "Quote the opening words.",
    "What rights are called unalienable?", "Name one right of the people named here.",
]


def figure_shared(args, doc: list[int]) -> list[str]:
    engine = Engine.load(args.model, backend="mlx", block_size=args.block_size)
    naive = Engine.load(args.model, backend="mlx", block_size=args.block_size, prefix_caching=False)
    system = engine.tokenizer.decode(doc[-args.system_tokens:])  # the document's end: no overlap with figure 2

    def msgs(i: int) -> list[dict]:
        return [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[i]}]

    n = args.shared_requests
    t0 = time.perf_counter()
    evs = [run(engine, 8, messages=msgs(i))[0] for i in range(n)]
    wall_cached = time.perf_counter() - t0
    t0 = time.perf_counter()
    naive_evs = [run(naive, 8, messages=msgs(i))[0] for i in range(args.naive_requests)]
    wall_naive = (time.perf_counter() - t0) * n / args.naive_requests
    engine.close()
    naive.close()
    prompt = sum(e.usage.prompt_tokens for e in evs)
    computed = sum(e.usage.prompt_tokens - e.usage.cached_prompt_tokens for e in evs)
    assert all(e.usage.cached_prompt_tokens == 0 for e in naive_evs)
    sys_tokens = len(engine.tokenizer.encode_chat([{"role": "system", "content": system}],
                                                  add_generation_prompt=False))
    measured = ("measured" if args.naive_requests == n
                else f"{args.naive_requests} measured, x{n / args.naive_requests:g}")
    return [
        f"**3. {n} requests sharing a system prompt** of {sys_tokens:,} template tokens (the end of "
        "`bench/data/`), each with its own question, 8 tokens generated each, one after another:",
        "",
        "| | prompt tokens computed | of naive | wall time, 8 requests |",
        "|---|---:|---:|---:|",
        f"| naive (`prefix_caching=False`) | {prompt:,} | 100% | {wall_naive:.1f} s ({measured}) |",
        f"| prefix cache | {computed:,} | {100 * computed / prompt:.1f}% | {wall_cached:.1f} s |",
        "",
        f"Per request, served from the cache: {', '.join(str(e.usage.cached_prompt_tokens) for e in evs)} tokens.",
        "",
    ]


# ---- 4. quantized KV --------------------------------------------------------------------------------

PER_CHANNEL_BLOCK = 32  # per-channel keys' rows: 32 tokens a group by default (--channel-block-size)


def figure_quantized(args, doc: list[int], shape) -> list[str]:
    ids = doc[args.ppl_offset:args.ppl_offset + args.ppl_tokens + 1]
    # (kv_bits, group size, key bits, keys per channel): key bits None means the keys take kv_bits; per-channel
    # keys are grouped over a block's tokens, with blocks of --channel-block-size
    configs = [(None, 64, None, False), (8, 64, None, False), (4, 64, None, False), (8, 32, None, False),
               (4, 32, None, False), (4, 64, 8, False), (4, 32, 8, False), (4, 64, None, True), (4, 32, None, True)]
    if args.kv_configs:
        configs = [c for i, c in enumerate(configs) if i == 0 or str(i) in args.kv_configs.split(",")]
    results = {}
    for config in configs:
        bits, gs, key_bits, per_channel = config
        engine = Engine.load(args.model, block_size=args.channel_block_size if per_channel else args.block_size,
                             kv_bits=bits, kv_group_size=gs, kv_key_bits=key_bits, kv_key_per_channel=per_channel)
        t0 = time.perf_counter()
        logp = engine.score(ids)
        st = engine.kv_stats()
        engine.close()
        results[config] = (float(np.exp(-logp.astype(np.float64).mean())),
                           st["bytes_per_block"] / st["block_size"], time.perf_counter() - t0)
        ppl, _, secs = results[config]
        log(f"  kv_bits {bits} key bits {key_bits or bits} gs {gs} per-channel keys {per_channel}: ppl {ppl:.4f} "
            f"({secs:.0f} s)")
    ppl0, here0, _ = results[configs[0]]
    fp16 = kv_bytes(shape, 1, itemsize=2)
    rows = []
    for config in configs:
        bits, gs, key_bits, per_channel = config
        ppl, here, secs = results[config]
        mac = kv_bytes(shape, 1, kv_bits=bits, itemsize=2, group_size=gs, key_bits=key_bits,
                       key_group_size=args.channel_block_size if per_channel else None)
        name = "fp16 (reference)" if bits is None else f"{bits}-bit, group {gs}"
        if key_bits not in (None, bits):
            name = f"{key_bits}-bit K, {bits}-bit V, group {gs}"
        if per_channel:
            name = f"{bits}-bit, keys per channel (blocks of {args.channel_block_size}), values group {gs}"
        change = "" if bits is None else f"{100 * (ppl - ppl0) / ppl0:+.3f}%"
        rows.append(f"| {name} | {mac:,} | {100 * mac / fp16:.1f}% | {here:,.0f} | {ppl:.4f} | {change} |")
    return [
        f"**4. Quantized KV**: bytes per token (K and V, every layer) and perplexity of "
        f"{len(ids) - 1:,} next-token predictions (from token {args.ppl_offset:,}) of "
        f"`bench/data/founding_documents.txt` through `Engine.score` "
        f"(the engine's paged KV path, prefill chunks of 512, so every query reads quantized K/V; quantized K and V "
        f"are stored smoothed and rotated, `mlx_engine/kv/smoothing.py`, with offsets and key scales measured at "
        f"load on a built-in calibration text, not this one; keys quantized per channel, `kv_key_per_channel`, are "
        f"stored as they are, only the values smoothed and rotated). The reference "
        f"row's KV is unquantized in the activation dtype ({'fp16' if mx.metal.is_available() else 'float32 here'}); "
        "bytes per token with fp16 scales and biases (a Mac) from `memory.kv_bytes`, and as stored here "
        "(scales and biases in the float32 activation dtype) from `kv_stats()`:",
        "",
        "| KV | bytes/token (fp16) | of fp16 | bytes/token here | perplexity | change |",
        "|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
    ]


CHAT_QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
                  "Explain photosynthesis in one sentence.", "List three primary colors.", "What is 12 times 12?",
                  "Who wrote Romeo and Juliet?", "Give me a tip for better sleep.",
                  "Translate 'good morning' into Spanish.", "What is a black hole?", "Name a mammal that can fly."]
CHAT_CHECK_CONFIGS = {
    "8-bit, group 64": dict(kv_bits=8),
    "4-bit, group 64, keys per token (smoothed, rotated)": dict(kv_bits=4, kv_key_per_channel=False),
    "4-bit, group 64, keys per channel (blocks of 16; the default)": dict(kv_bits=4),
    "4-bit, group 64, keys per channel (blocks of 32)": dict(kv_bits=4, block_size=32),
}


def chat_check(args) -> list[str]:
    """Short chats, where a long text's perplexity says little: each question's greedy reply (24 tokens) with
    unquantized KV, then per KV format the mean |change| of the reply tokens' log-probabilities (teacher-forced
    through `Engine.score`) and how many reply tokens greedy decoding reproduces before it first differs."""
    ref = Engine.load(args.model)
    chats = []
    for q in CHAT_QUESTIONS:
        msgs = [{"role": "user", "content": q}]
        ev = list(ref.generate(GenerationRequest(messages=msgs, sampling=SamplingParams(temperature=0,
                                                                                        max_tokens=24))))
        ids = ref.tokenizer.encode_chat(msgs, add_generation_prompt=True)
        reply = [t for e in ev for t in e.token_ids]
        chats.append((ids, reply, ref.score(ids + reply)))
    ref.close()
    total = sum(len(r) for _, r, _ in chats)
    rows = []
    for name, opts in CHAT_CHECK_CONFIGS.items():
        engine = Engine.load(args.model, **opts)
        changes, kept = [], 0
        for ids, reply, base in chats:
            changes.append(float(np.abs(engine.score(ids + reply) - base)[len(ids) - 1:].mean()))
            ev = list(engine.generate(GenerationRequest(prompt_token_ids=ids, sampling=SamplingParams(
                temperature=0, max_tokens=len(reply)))))
            got = [t for e in ev for t in e.token_ids]
            kept += next((i for i, (a, b) in enumerate(zip(got, reply)) if a != b), min(len(got), len(reply)))
        engine.close()
        log(f"  chat check {name}: |dlogp| {np.mean(changes):.3f}, {kept} of {total} tokens before divergence")
        rows.append(f"| {name} | {np.mean(changes):.3f} | {kept} of {total} |")
    return [
        f"**4b. Short chats** ({len(CHAT_QUESTIONS)} one-line questions, greedy replies of up to 24 tokens with "
        "unquantized KV): per KV format, the mean |change| in the reply tokens' log-probabilities, and the reply "
        "tokens greedy decoding reproduces before its first different token (summed over the questions):",
        "",
        "| KV | mean abs change of log p (nats/token) | greedy tokens before divergence |",
        "|---|---:|---:|",
        *rows,
        "",
    ]


def split_kv_check(args, doc: list[int]) -> list[str]:
    """Which of K and V 4-bit hurts: the same affine quantization (mx.quantize, per token and head, group
    64) applied to K only, V only or both inside mlx-lm's contiguous KVCache, one forward, no paging."""
    from mlx_lm.models.cache import KVCache

    class FakeQuantKVCache(KVCache):
        def __init__(self, quantize_k: bool, quantize_v: bool, bits: int = 4, group_size: int = 64):
            super().__init__()
            self.qk, self.qv, self.bits, self.group_size = quantize_k, quantize_v, bits, group_size

        def _fq(self, x: mx.array) -> mx.array:  # (B, Hkv, L, D), quantized along D
            q, s, b = mx.quantize(x.reshape(-1, x.shape[-1]), group_size=self.group_size, bits=self.bits)
            return mx.dequantize(q, s, b, group_size=self.group_size, bits=self.bits).reshape(x.shape)

        def update_and_fetch(self, keys, values):
            return super().update_and_fetch(self._fq(keys) if self.qk else keys,
                                            self._fq(values) if self.qv else values)

    engine = Engine.load(args.model, paged_kv=False)
    ids = doc[:min(args.ppl_tokens, 512) + 1]
    runner = engine.diagnostics().runner  # one unchunked forward on the engine thread, not the engine's path

    def ppl(qk: bool, qv: bool) -> float:
        layers = [FakeQuantKVCache(qk, qv) for _ in runner.model.layers]
        logits = runner.model.logits(runner.forward(mx.array([ids[:-1]], dtype=mx.int32), layers))[0]
        logp = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True)
        lp = np.array(mx.take_along_axis(logp, mx.array(ids[1:], dtype=mx.int32)[:, None], axis=-1)[:, 0])
        return float(np.exp(-lp.astype(np.float64).mean()))

    res = {(qk, qv): engine.diagnostics().call(lambda qk=qk, qv=qv: ppl(qk, qv))
           for qk, qv in ((False, False), (True, False), (False, True), (True, True))}
    engine.close()
    base = res[(False, False)]
    cells = " | ".join(f"{res[k]:.4f} ({100 * (res[k] - base) / base:+.1f}%)"
                       for k in ((True, False), (False, True), (True, True)))
    return [
        f"4-bit split check (`--split-kv-check`): the same quantization applied to K only / V only / both in mlx-lm's "
        f"`KVCache` (fake-quantized, one forward over {len(ids) - 1} predictions; unquantized {base:.4f}):",
        "",
        "| 4-bit K only | 4-bit V only | 4-bit K and V |",
        "|---:|---:|---:|",
        f"| {cells} |",
        "",
    ]


# ---- 5. decode paged vs contiguous ------------------------------------------------------------------

QUANTIZED_DECODE = {  # --decode-quantized: the paged side again with quantized KV
    "paged 8-bit g64": dict(kv_bits=8, kv_group_size=64),
    "paged 4-bit g64, keys per token": dict(kv_bits=4, kv_group_size=64, kv_key_per_channel=False),
    "paged 4-bit, keys per channel": dict(kv_bits=4, kv_group_size=64, kv_key_per_channel=True,
                                          block_size=PER_CHANNEL_BLOCK),
}


def figure_decode(args, doc: list[int]) -> list[str]:
    engines = {"paged": Engine.load(args.model, backend="mlx", block_size=args.block_size, paged_kv=True),
               "contiguous": Engine.load(args.model, paged_kv=False)}
    if args.decode_quantized:
        engines.update({name: Engine.load(args.model, **{"block_size": args.block_size, **opts})
                        for name, opts in QUANTIZED_DECODE.items()})
    long_ids = (doc * (max(args.contexts) // len(doc) + 1))[:max(args.contexts)]
    rows = []
    for ctx in sorted(args.contexts):
        ids = long_ids[:ctx]
        for name, engine in engines.items():  # prefill once; each repeat then reuses all but the last token
            t0 = time.perf_counter()
            run(engine, 2, ids=ids)
            log(f"  {name} prefill to {ctx}: {time.perf_counter() - t0:.1f} s")
        tps: dict[str, list[float]] = {k: [] for k in engines}
        for r in range(args.repeats):
            order = list(engines) if r % 2 == 0 else list(engines)[::-1]
            for name in order:
                ev, _ = run(engines[name], args.decode_tokens, ids=ids)
                assert ev.usage.cached_prompt_tokens >= ctx - engines[name].kv_stats().get("block_size", args.block_size), ev.usage
                tps[name].append(ev.stats.decode_tps)
                log(f"  {name} ctx {ctx} #{r}: {ev.stats.decode_tps:.2f} tok/s")
        p, c = statistics.median(tps["paged"]), statistics.median(tps["contiguous"])
        spread = lambda xs: f"{min(xs):.2f}-{max(xs):.2f}"  # noqa: E731
        rows.append(f"| {ctx:,} | {c:.2f} ({spread(tps['contiguous'])}) | {p:.2f} ({spread(tps['paged'])}) | "
                    f"**{100 * (c - p) / c:+.1f}%** |")
        for name in QUANTIZED_DECODE if args.decode_quantized else ():
            x = statistics.median(tps[name])
            rows.append(f"| {ctx:,}, {name} | | {x:.2f} ({spread(tps[name])}) | {100 * (c - x) / c:+.1f}% |")
    for engine in engines.values():
        engine.close()
    return [
        f"**5. Decode, paged against contiguous KV** on the reference path (paged: block tables read by "
        f"`kernels_metal.paged_decode_attention`'s MLX-ops reference; contiguous: mlx-lm `KVCache` and "
        f"`mx.fast.scaled_dot_product_attention`), greedy, {args.decode_tokens} tokens after the context, "
        f"tok/s as the engine's `decode_tps`; medians (min-max) of {args.repeats} runs each, alternating:",
        "",
        "| context | contiguous tok/s | paged tok/s | paged overhead |",
        "|---:|---:|---:|---:|",
        *rows,
        "",
    ]


def machine() -> str:
    cpu = subprocess.run(["sh", "-c", "lscpu | grep 'Model name' | sed 's/.*: *//'"], capture_output=True,
                         text=True).stdout.strip() or platform.processor()
    dev = "Metal" if mx.metal.is_available() else "CPU"
    return (f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores, "
            f"MLX {mx.__version__} on {dev}, mlx-lm {__import__('mlx_lm').__version__}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--quick", action="store_true", help="a smoke test: small contexts, one repeat")
    p.add_argument("--only", default="1,2,3,4,5", help="comma-separated figures to run")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--channel-block-size", type=int, default=PER_CHANNEL_BLOCK, choices=(16, 32),
                   help="figure 4: the block size of the rows with keys per channel (default 32)")
    p.add_argument("--chat-check", action="store_true",
                   help="figure 4: also the quantized formats on short chats (log-probability change, greedy agreement)")
    p.add_argument("--decode-quantized", action="store_true",
                   help="figure 5: also decode with 4-bit KV, per-token and with keys per channel")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--split-kv-check", action="store_true",
                   help="with figure 4: 4-bit K only / V only / both, fake-quantized in mlx-lm's KVCache")
    p.add_argument("--ppl-tokens", type=int, default=None, help="figure 4: predictions scored (default 2,048)")
    p.add_argument("--kv-configs", default=None,
                   help="figure 4: comma-separated indices (1-8) of the quantized configurations to run (default: all)")
    p.add_argument("--ppl-offset", type=int, default=0,
                   help="figure 4: score the text from this token on (a second window checks robustness)")
    args = p.parse_args()
    figures = {int(x) for x in args.only.split(",")}
    q = args.quick
    args.repeats = args.repeats or (1 if q else 3)
    args.cold_repeats = 1
    args.histories = [128, 256] if q else [512, 1024, 2048]
    args.system_tokens = 256 if q else 1024
    args.shared_requests = 8
    args.naive_requests = 2  # each is a full 1K prefill (~10-40 s here): measure 2, scale to 8
    default_ppl_tokens = 256 if q else 2048
    args.ppl_tokens = args.ppl_tokens or default_ppl_tokens
    args.contexts = [256, 512] if q else [1024, 4096]
    args.decode_tokens = 8 if q else 16

    t_start = time.perf_counter()
    probe = Engine.load(args.model)
    info = probe.info
    doc = document_ids(probe)
    shape = kv_shape(args.model)
    probe.close()
    log(f"{info.name}: {len(doc)} document tokens")
    steps = {1: lambda: figure_waste(args, shape), 2: lambda: figure_ttft(args, doc),
             3: lambda: figure_shared(args, doc),
             4: lambda: figure_quantized(args, doc, shape) + (split_kv_check(args, doc) if args.split_kv_check else [])
             + (chat_check(args) if args.chat_check else []),
             5: lambda: figure_decode(args, doc)}
    cmd = ("uv run python bench/kv.py" + (" --quick" if q else "")
           + (" --split-kv-check" if args.split_kv_check else "")
           + (f" --ppl-tokens {args.ppl_tokens}" if args.ppl_tokens != default_ppl_tokens else "")
           + (f" --ppl-offset {args.ppl_offset}" if args.ppl_offset else "")
           + (f" --kv-configs {args.kv_configs}" if args.kv_configs else "")
           + (" --decode-quantized" if args.decode_quantized else "")
           + (" --chat-check" if args.chat_check else "")
           + (f" --channel-block-size {args.channel_block_size}" if args.channel_block_size != PER_CHANNEL_BLOCK
              else "")) + (
        f" --only {args.only}" if figures != set(steps) else "")
    print(f"### {platform.system()}, {'Metal' if mx.metal.is_available() else 'CPU'} ({datetime.date.today()})\n")
    print(f"- Command: `{cmd}`")
    print(f"- Machine: {machine()}")
    print(f"- Model: {info.name}, activations {info.dtype}, KV block size {args.block_size}\n", flush=True)
    for k in sorted(figures):  # each figure's table as soon as it is measured
        t0 = time.perf_counter()
        log(f"figure {k}")
        print("\n".join(steps[k]()), flush=True)
        log(f"figure {k}: {time.perf_counter() - t0:.0f} s")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"Whole run: {time.perf_counter() - t_start:.0f} s; load average at the end {load:.1f} "
          f"on {os.cpu_count()} cores.")

if __name__ == "__main__":
    main()
