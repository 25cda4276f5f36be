"""Structured output: what holding replies to a JSON Schema costs and what it buys, in one run.

    uv run python bench/structured.py [--model M] [--max-tokens 96] [--repeats 2] [--parts json,tools,extraction]

Eight chat requests that ask for JSON (four prompts, two seeds, temperature 0.7), each run two ways on the same
engine: free (the peer: how the engine, mlx-lm or any server without constrained decoding answers) and held to a
JSON Schema (`response_format`). Each way runs one request at a time and then all eight at once; the ways
alternate, `--repeats` times, so the machine's drift hits both alike. Prints a markdown table: replies that parse
as JSON, replies valid against the schema, decode tokens/s (median over the one-at-a-time requests; aggregate
for eight at once), and the grammar's host time per token (mask + advance, replayed on each constrained reply).
Then tool calls: eight questions that need one of two offered functions, with the server's tool prompt, free and
held to its grammar (greedy): replies that call an offered function with valid arguments, the right one, with the
right arguments. Then JSON extraction (replies that copy spans of their prompt) held to a schema, greedy, plain
against prompt lookup and "auto": tokens per target forward, decode tokens/s, and whether the reply is identical.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_engine import Engine, GenerationRequest, ResponseFormat, SamplingParams  # noqa: E402
from mlx_engine.structured import constrain  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
PROMPTS = [
    "Invent a person. Reply with JSON only: name, age, city, hobbies (a list).",
    "Give me a JSON object describing a fictional teacher with name, age, city and hobbies.",
    "Return JSON for a made-up athlete: name, age, city, hobbies.",
    "Describe a character from a novel as JSON with the keys name, age, city and hobbies.",
]


def schema_valid(value: object) -> bool:
    """SCHEMA, checked by hand (no jsonschema dependency)."""
    if not isinstance(value, dict) or set(value) != set(SCHEMA["required"]):
        return False
    name, age, city, hobbies = (value[k] for k in ("name", "age", "city", "hobbies"))
    return (isinstance(name, str) and len(name) <= 40 and isinstance(city, str) and len(city) <= 40
            and isinstance(age, int) and not isinstance(age, bool) and 0 <= age <= 150
            and isinstance(hobbies, list) and len(hobbies) <= 3
            and all(isinstance(h, str) and len(h) <= 30 for h in hobbies))


def parse(text: str) -> object | None:
    t = text.strip()
    if t.startswith("```"):  # a free reply often fences its JSON: count it if the fence holds valid JSON
        t = t.strip("`")
        t = t[4:] if t.startswith("json") else t
    try:
        return json.loads(t)
    except ValueError:
        return None


def requests(fmt: ResponseFormat | None, max_tokens: int) -> list[GenerationRequest]:
    return [GenerationRequest(messages=[{"role": "user", "content": p}],
                              sampling=SamplingParams(temperature=0.7, seed=seed, max_tokens=max_tokens,
                                                      response_format=fmt))
            for p in PROMPTS for seed in (1, 2)]


def collect(stream) -> tuple[str, list[int], object]:
    events = list(stream)
    return "".join(e.text for e in events), [t for e in events for t in e.token_ids], events[-1]


def run(engine: Engine, fmt: ResponseFormat | None, max_tokens: int) -> dict:
    one = [collect(engine.generate(r)) for r in requests(fmt, max_tokens)]
    t0 = time.perf_counter()
    streams = [engine.generate(r) for r in requests(fmt, max_tokens)]
    together = [collect(s) for s in streams]
    wall = time.perf_counter() - t0
    parsed = [parse(text) for text, _, _ in one + together]
    return {
        "replies": len(parsed),
        "json": sum(p is not None for p in parsed),
        "valid": sum(schema_valid(p) for p in parsed),
        "decode_tps": [final.stats.decode_tps for _, _, final in one if final.stats.decode_tps > 0],
        "tokens_one": [len(tokens) for _, tokens, _ in one],
        "aggregate_tps": sum(len(tokens) for _, tokens, _ in together) / wall,
        "replies_tokens": [tokens for _, tokens, _ in one],
        "finish": [final.finish_reason for _, _, final in one + together],
    }


def grammar_us_per_token(engine: Engine, fmt: ResponseFormat, replies: list[list[int]]) -> float:
    times = []
    for tokens in replies:
        c = constrain(engine.tokenizer, engine.info.vocab_size, fmt)
        for token in tokens:
            t = time.perf_counter()
            c.allowed()
            c.consume(token)
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                            "parameters": {"type": "object", "properties": {
                                                "a": {"type": "number"}, "b": {"type": "number"}},
                                                "required": ["a", "b"]}}}]
# (question, the call it needs: name and arguments that must match)
TOOL_PROMPTS = [("What's the weather in Paris?", "get_weather", {"city": "Paris"}),
                ("Is it raining in Tokyo right now?", "get_weather", {"city": "Tokyo"}),
                ("How warm is it in Cairo today?", "get_weather", {"city": "Cairo"}),
                ("Tell me the weather for Berlin.", "get_weather", {"city": "Berlin"}),
                ("What is 2 plus 3?", "add", {"a": 2, "b": 3}),
                ("Add 17 and 25.", "add", {"a": 17, "b": 25}),
                ("What is the sum of 100 and 7?", "add", {"a": 100, "b": 7}),
                ("Compute 4.5 + 1.5.", "add", {"a": 4.5, "b": 1.5})]


def tool_calls(engine: Engine, grammar: bool, max_tokens: int) -> dict[str, int]:
    """The server's tool prompt for each question, with and without its grammar: replies that are a call of a
    declared function with valid arguments, of the right function, and with the right arguments."""
    from app.server.tool_request import parse_tools
    from app.toolcalls.tools import with_tools

    tools = parse_tools({"tools": TOOLS, "tool_choice": "auto"})
    assert tools is not None
    fmt = ResponseFormat("json_schema", schema=tools.schema()) if grammar else None
    declared = {f["name"]: f["parameters"] for f in tools.functions}
    counts = {"valid call": 0, "right function": 0, "right arguments": 0}
    for question, name, want in TOOL_PROMPTS:
        text, _, _ = collect(engine.generate(GenerationRequest(
            messages=with_tools([{"role": "user", "content": question}], tools),
            sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, response_format=fmt))))
        value = parse(text)
        calls = value.get("tool_calls") if isinstance(value, dict) else None
        call = calls[0] if isinstance(calls, list) and len(calls) == 1 and isinstance(calls[0], dict) else None
        args = call.get("arguments") if call else None
        params = declared.get(call.get("name")) if call else None
        if params is None or not isinstance(args, dict) or not set(params["required"]) <= set(args) <= set(
                params["properties"]):
            continue
        counts["valid call"] += 1
        if call["name"] == name:
            counts["right function"] += 1
            counts["right arguments"] += all(args.get(k) == v for k, v in want.items())
    return counts


EXTRACT = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40},
                   "email": {"type": "string", "pattern": "^[a-z.-]+@[a-z.-]+$", "maxLength": 60},
                   "city": {"type": "string", "maxLength": 30}, "order": {"type": "string", "pattern": "^ORD-[0-9-]+$",
                                                                          "maxLength": 20},
                   "items": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3}},
    "required": ["name", "email", "city", "order", "items"],
    "additionalProperties": False,
}
EXTRACT_PROMPTS = [
    "Extract the customer's name, email, city, order number and items as JSON from this message:\n\n"
    "Hello, this is Margaret Okonkwo-Hansen (margaret.okonkwo-hansen@riverbend-mail.example). I live in "
    "Port Elizabeth and my order ORD-2024-118733 arrived without the stainless steel garlic press and the "
    "bamboo cutting board. Could you send them?",
    "From the note below, give JSON with name, email, city, order number and items.\n\nNote: customer "
    "Bartholomew Fitzgerald-Quinn, bart.fitzquinn@northwind-traders.example, Saskatoon; order ORD-77-50291: "
    "two ceramic pour-over coffee drippers, one cast iron skillet.",
]


def extraction_with_speculation(engine: Engine, modes: tuple[str, ...], max_tokens: int) -> list[tuple]:
    """JSON extraction (the reply copies spans of the prompt), held to EXTRACT, greedy: each speculative mode
    against plain decoding under the same grammar. Rows: (mode, tokens, forwards, tok/s, identical to plain)."""
    rows = []
    fmt = ResponseFormat("json_schema", schema=EXTRACT)
    plain: dict[int, list[int]] = {}
    for mode in modes:
        tokens = forwards = 0
        seconds = 0.0
        same = True
        for i, prompt in enumerate(EXTRACT_PROMPTS):
            t0 = time.perf_counter()
            _, ids, final = collect(engine.generate(GenerationRequest(
                messages=[{"role": "user", "content": prompt}],
                sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, response_format=fmt,
                                        speculative=None if mode == "plain" else mode))))
            seconds += time.perf_counter() - t0 - final.stats.ttft_s
            tokens += len(ids)
            forwards += final.stats.target_forwards
            if mode == "plain":
                plain[i] = ids
            same = same and ids == plain[i]
        rows.append((mode, tokens, forwards, (tokens - len(EXTRACT_PROMPTS)) / seconds, same))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--parts", default="json,tools,extraction", help="which tables: json, tools, extraction")
    args = ap.parse_args()
    engine = Engine.load(args.model)
    print(f"- date: {datetime.date.today()}; machine: {platform.platform()}, {platform.processor() or 'cpu'}")
    print(f"- model: {engine.info.name}; backend {engine.info.backend} on {engine.info.device}")
    print(f"- command: `uv run python bench/structured.py --max-tokens {args.max_tokens} --repeats {args.repeats} "
          f"--parts {args.parts}`")
    parts = set(args.parts.split(","))
    if "json" in parts:
        fmt = ResponseFormat("json_schema", schema=SCHEMA)
        engine.generate(GenerationRequest(prompt="warm up", sampling=SamplingParams(max_tokens=2)))
        runs: dict[str, list[dict]] = {"free": [], "schema": []}
        for _ in range(args.repeats):
            for name, f in (("free", None), ("schema", fmt)):
                runs[name].append(run(engine, f, args.max_tokens))
                print(f"{name}: {runs[name][-1]['aggregate_tps']:.1f} tok/s at 8", file=sys.stderr)
        us = grammar_us_per_token(engine, fmt, [t for r in runs["schema"] for t in r["replies_tokens"]])

        print()
        print("| replies | parse as JSON | valid against the schema | finish stop / length | tokens per reply (median) "
              "| decode tok/s, one at a time (median) | tok/s, 8 at once |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        med = {}
        for name in ("free", "schema"):
            rs = runs[name]
            n = sum(r["replies"] for r in rs)
            finish = [f for r in rs for f in r["finish"]]
            tps = statistics.median([x for r in rs for x in r["decode_tps"]])
            agg = statistics.median([r["aggregate_tps"] for r in rs])
            med[name] = (tps, agg)
            print(f"| {name} | {sum(r['json'] for r in rs)}/{n} | {sum(r['valid'] for r in rs)}/{n} | "
                  f"{finish.count('stop')} / {finish.count('length')} | "
                  f"{statistics.median([x for r in rs for x in r['tokens_one']]):.0f} | {tps:.1f} | {agg:.1f} |")
        print()
        print(f"- schema / free: decode {med['schema'][0] / med['free'][0]:.2f}x one at a time, "
              f"{med['schema'][1] / med['free'][1]:.2f}x eight at once")
        print(f"- grammar host time per token (mask + advance, median): {us:.0f} us, "
              f"{us / 1e4 * med['free'][0]:.2f}% of a one-at-a-time decode step")

    if "tools" in parts:
        print()
        print(f"Tool calls: {len(TOOL_PROMPTS)} questions that need get_weather or add (both offered, tool_choice auto, "
              "the server's tool prompt), greedy:")
        print()
        print("| replies | a call of an offered function, valid arguments | the right function | the right arguments |")
        print("|---|---:|---:|---:|")
        for name, grammar in (("free", False), ("held to the tool-call grammar", True)):
            c = tool_calls(engine, grammar, args.max_tokens)
            n = len(TOOL_PROMPTS)
            print(f"| {name} | {c['valid call']}/{n} | {c['right function']}/{n} | {c['right arguments']}/{n} |")

    if "extraction" in parts:
        print()
        print(f"JSON extraction with speculative decoding under the schema: {len(EXTRACT_PROMPTS)} prompts whose reply "
              "copies names, addresses and numbers from the prompt, greedy, plain against each mode (after the first "
              "token; median of --repeats):")
        print()
        print("| mode | tokens | target forwards | tokens per forward | decode tok/s | speedup | identical to plain |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        reps = [extraction_with_speculation(engine, ("plain", "prompt-lookup", "auto"), 160) for _ in range(args.repeats)]
        base = statistics.median(r[0][3] for r in reps)
        for j, (mode, tokens, forwards, _, _) in enumerate(reps[0]):
            tps = statistics.median(r[j][3] for r in reps)
            same = all(r[j][4] for r in reps)
            print(f"| {mode} | {tokens} | {forwards} | {tokens / forwards:.2f} | {tps:.1f} | {tps / base:.2f}x | "
                  f"{'yes' if same else 'NO'} |")
    engine.close()


if __name__ == "__main__":
    main()
