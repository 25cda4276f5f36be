"""What splitting reasoning from the answer costs a decode step, in one run.

    uv run python bench/reasoning_parser.py [--model M] [--max-tokens 64] [--rounds 3]

The embedded SmolLM2 has no reasoning, so the same model is loaded twice: with its own template (no parser: the
peer) and with that template plus an opened `<think>` at the end of the generation prompt (a "think" parser on
every request, in its dearest state for the whole reply: inside the reasoning, `</think>` spelled by text tokens, so
each token's text is searched and a possible tag's start held back). One request at a time, greedy, ignore_eos,
`--max-tokens` tokens; the two ways alternate, `--rounds` times, so the machine's drift hits both alike. Prints the
median decode tokens/s of each, and the parser's own time per token (`ThinkParser.feed` replayed on the reply's
token texts).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_engine import Engine, GenerationRequest, SamplingParams  # noqa: E402
from mlx_engine.reasoning import ThinkParser, think_tags  # noqa: E402

PROMPT = [{"role": "user", "content": "Explain why the sky is blue, step by step."}]


def decode_tps(engine: Engine, max_tokens: int) -> tuple[float, list[tuple[int, str]], str]:
    """One greedy reply: its decode tokens/s, its (token id, text) pairs, its reasoning."""
    request = GenerationRequest(messages=PROMPT, sampling=SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                         ignore_eos=True))
    events = list(engine.generate(request))
    pieces = [(e.token_ids[0], engine.tokenizer.decode(list(e.token_ids))) for e in events if e.token_ids]
    return events[-1].stats.decode_tps, pieces, "".join(e.reasoning for e in events)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    plain = Engine.load(args.model)
    template = plain.tokenizer.chat_template + "{% if add_generation_prompt %}<think>\n{% endif %}{# </think> #}"
    thinking = Engine.load(args.model, chat_template=template)
    assert plain.info.reasoning is None and thinking.info.reasoning == "think", "the think template was not read"
    tps: dict[str, list[float]] = {"off": [], "on": []}
    for engine in (plain, thinking):  # warm-up
        decode_tps(engine, 8)
    pieces: list[tuple[int, str]] = []
    for _ in range(args.rounds):
        tps["off"].append(decode_tps(plain, args.max_tokens)[0])
        t, pieces, reasoning = decode_tps(thinking, args.max_tokens)
        tps["on"].append(t)
        assert reasoning, "the reply was not read as reasoning"

    tags = think_tags(thinking.tokenizer)
    assert tags is not None
    reps = 200
    t0 = time.perf_counter()
    for _ in range(reps):
        parser = ThinkParser(tags, opened=True)
        for token_id, text in pieces:
            parser.feed(token_id, text)
    feed_us = (time.perf_counter() - t0) / (reps * len(pieces)) * 1e6

    off, on = statistics.median(tps["off"]), statistics.median(tps["on"])
    print(f"{plain.info.name}, {plain.info.backend}/{plain.info.device}, {platform.machine()}, "
          f"{args.max_tokens} tokens x {args.rounds} rounds, greedy, one request at a time")
    print("| parser | decode tok/s (median) | rounds |")
    print("|---|---|---|")
    print(f"| off (no reasoning family) | {off:.1f} | {', '.join(f'{x:.1f}' for x in tps['off'])} |")
    print(f"| on (think, inside the reasoning, text tags) | {on:.1f} | {', '.join(f'{x:.1f}' for x in tps['on'])} |")
    print(f"on / off: {on / off:.3f}; ThinkParser.feed: {feed_us:.2f} us a token")
    plain.close()
    thinking.close()


if __name__ == "__main__":
    main()
