"""`roofline`: the command line, a thin front end over mlx_engine's public API."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlx_engine.api import (SPECULATIVE_MODES, GenerationRequest, ResponseFormat, RooflineError,
                            SamplingParams)

from app.cli_usage import EXIT_USAGE, OneLineErrorParser
from app.embed_cmd import cmd_embed
from app.inspect_cmd import cmd_kv, cmd_logits, cmd_tokens
from app.options import load_engine, reasoning_effort_arg, runner_args, runner_options
from app.serve_cmd import add_serve_args, cmd_serve

MODEL_HELP = ("GGUF file, model folder, ORG/NAME[:QUANT] (Hugging Face; pulled when missing), ollama:NAME[:TAG] or "
              "lmstudio:PUBLISHER/REPO[/FILE] (default: the embedded SmolLM2; `roofline models` lists them)")
SPECULATIVE_CHOICES = ("off", *SPECULATIVE_MODES)


def _fail(message: str) -> int:
    print(f"roofline: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog="roofline",
        description="On-device LLM inference with MLX, every token measured against the memory-bandwidth roofline.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def kv_args(parser: argparse.ArgumentParser) -> None:
        kv = parser.add_argument_group("KV cache")
        kv.add_argument("--max-context", type=int, metavar="N",
                        help="cap the context at N tokens (default: the model's own). A model loads when its weights "
                        "and the KV of N tokens (4,096 without this flag) fit in this machine's memory")
        kv.add_argument("--kv-bits", type=int, choices=(4, 8),
                        help="quantize the KV cache (default: unquantized). 8: within 0.2%% of unquantized "
                        "perplexity at 53%% of fp16's bytes; 4: keys grouped per channel, under 3%% at about a third")
        kv.add_argument("--block-size", type=int, choices=(16, 32), default=16,
                        help="tokens per KV block (default 16; 32 suits --kv-bits 4 best)")

    def draft_args(parser: argparse.ArgumentParser, speculative: str | None = None) -> None:
        sp = parser.add_argument_group("speculative decoding")
        if speculative is not None:
            sp.add_argument("--speculative", choices=SPECULATIVE_CHOICES,
                            help=f"speculative decoding for {speculative}, drafted tokens verified several in one "
                            "forward: 'auto' where the backend's cost curve and the acceptance say it pays (prompt "
                            "lookup, and the draft model where one is loaded), 'prompt-lookup', 'self' (the model's "
                            "first layers), 'draft' (--draft-model) or 'off' (default: auto with --draft-model, "
                            "else off)")
        sp.add_argument("--draft-model", metavar="MODEL",
                        help="a small model with the model's tokenizer that drafts tokens for it to verify (GGUF file, "
                        "model folder or HF repo id), e.g. SmolLM2-135M beside SmolLM2-1.7B")
        sp.add_argument("--draft-bits", type=int, choices=(4, 8),
                        help="hold the draft model at 4 or 8 bits, so that it drafts cheaply (it may then be the "
                        "model itself; the torch backend on the CPU: 8)")

    def distributed_arg(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--distributed", metavar="MODE",
                            help="pipeline (layer ranges per rank) or tensor (heads and MLP columns split): the model "
                            "across the ranks mlx.launch started; rank 0 runs the command, the others serve it "
                            "(docs/distributed.md)")

    def template_arg(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--chat-template", metavar="FILE",
                            help="a Jinja chat template to use instead of the model's own (a .jinja file, or a "
                            "tokenizer_config.json with a chat_template field)")

    g = sub.add_parser("generate", help="stream a reply to one prompt and print the stats")
    g.add_argument("--model", "-m", help=MODEL_HELP)
    g.add_argument("--prompt", "-p", required=True, help="the user message")
    g.add_argument("--system", "-s", help="a system message")
    g.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    g.add_argument("--max-tokens", "-n", type=int, default=256)
    g.add_argument("--temp", type=float, default=0.0, help="temperature (0: greedy, the default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object (reply, usage, stats) at the end")
    fmt = g.add_mutually_exclusive_group()
    fmt.add_argument("--json-schema", metavar="FILE", help="hold the reply to this JSON Schema (a .json file)")
    fmt.add_argument("--json-object", action="store_true", help="the reply is one JSON object (JSON mode)")
    fmt.add_argument("--regex", metavar="PATTERN", help="the reply is text this regular expression matches whole")
    r = g.add_argument_group("reasoning models")
    reasoning_effort_arg(r)
    r.add_argument("--reasoning-budget", type=int, metavar="N",
                   help="at most N tokens of thinking, then the model is made to close it and answer")
    r.add_argument("--hide-reasoning", action="store_true",
                   help="leave out the thinking (by default it streams to stderr, dimmed on a terminal; stdout has "
                   "only the answer)")
    template_arg(g)
    runner_args(g)
    kv_args(g)
    distributed_arg(g)
    draft_args(g, "the reply")
    g.add_argument("--num-draft-tokens", type=int, default=SamplingParams.num_draft_tokens, metavar="K",
                   help=f"most draft tokens per verification, 1-16 (default {SamplingParams.num_draft_tokens}; "
                   "adapted per step)")

    c = sub.add_parser("chat", help="open the chat app (the default when run with no arguments in a terminal)")
    c.add_argument("--model", "-m", help=MODEL_HELP)
    reasoning_effort_arg(c.add_argument_group("reasoning models"),
                         "; in the app, the thinking effort of new chats (F9 or ctrl+s changes a chat's own)")
    runner_args(c)
    kv_args(c)
    distributed_arg(c)
    draft_args(c)

    lg = sub.add_parser("logits", help="write the float32 logits (T, vocab) of one forward pass to .npy")
    lg.add_argument("--model", "-m")
    lg.add_argument("--token-ids", required=True, help="comma-separated token ids, e.g. 1,2,3")
    lg.add_argument("--output", "-o", required=True, help="output .npy file")

    k = sub.add_parser("kv", help="the KV cache bytes a configuration needs (read from config.json or GGUF metadata)")
    k.add_argument("--model", "-m", help=MODEL_HELP)
    k.add_argument("--context", "-c", type=int, required=True, help="tokens per sequence")
    k.add_argument("--batch", "-b", type=int, default=1, help="concurrent sequences")
    k.add_argument("--kv-bits", type=int, choices=(4, 8), help="quantized KV (group size 64)")
    k.add_argument("--kv-key-bits", type=int, choices=(4, 8),
                   help="the keys' bits, when not --kv-bits (needs --kv-bits)")
    k.add_argument("--block-size", type=int, choices=(16, 32), default=16,
                   help="tokens per KV block (default 16): 4-bit keys are grouped per channel over a block")
    k.add_argument("--dtype", choices=("float16", "bfloat16", "float32"),
                   help="KV dtype when not quantized, and of the scales when quantized (default: what this "
                   "machine's engine stores: float32 on MLX's CPU backend, the checkpoint's on a Mac)")
    k.add_argument("--distributed", metavar="MODE",
                   help="pipeline or tensor: also each rank's layers, weights and KV (as --distributed would split it)")
    k.add_argument("--ranks", type=int, default=2, help="ranks for --distributed (default 2)")

    sv = sub.add_parser("serve", help="serve models over OpenAI-compatible (and Ollama's) HTTP APIs")
    sv.add_argument("--model", "-m", action="append", default=[],
                    help="the model to serve: " + MODEL_HELP + ". Repeat to serve several, loaded by name when a "
                    "request names one; without -m every model `roofline models` lists is served so")
    add_serve_args(sv)
    runner_args(sv)
    template_arg(sv)
    kv_args(sv)
    distributed_arg(sv)
    draft_args(sv, "a request that does not set 'speculative' itself (a speculating request verifies in a forward "
               "of its own, outside the batch)")

    from app.bench import add_parser as add_bench
    from app.embed_cmd import add_parser as add_embed
    from app.parity_cmd import add_parser as add_parity

    add_bench(sub)
    add_parity(sub)
    add_embed(sub)
    from app.models_cmd import add_parsers as add_model_commands

    add_model_commands(sub)  # models, pull, rm, convert

    t = sub.add_parser("tokens", help="show token pieces and ids of a text")
    t.add_argument("--tokenizer", "-t", help="model folder, tokenizer.json or GGUF file (default: embedded model)")
    t.add_argument("--json", action="store_true", help='print {"ids": [...]} (no BOS added)')
    t.add_argument("text")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        if sys.stdin.isatty() and sys.stdout.isatty():
            return cmd_chat(argparse.Namespace(model=None, device="auto", threads=None, compile=None))
        parser.print_help()
        return 0
    from app.models_cmd import COMMANDS as MODEL_COMMANDS

    try:
        code = _serve_other_rank(args)
        if code is not None:
            return code
        code = {"chat": cmd_chat, "generate": cmd_generate, "logits": cmd_logits, "tokens": cmd_tokens,
                "kv": cmd_kv, "serve": lambda a: cmd_serve(a, {**_load_options(a), **runner_options(a)}, _speculative(a)), "bench": cmd_bench, "parity": cmd_parity,
                "embed": cmd_embed,
                **MODEL_COMMANDS}[args.command](args)
    except RooflineError as e:
        code = _fail(str(e))
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    if getattr(args, "distributed", None) is not None:
        from mlx_engine import distributed

        distributed.exit_if_lost()
    return code


def _speculative(args: argparse.Namespace) -> str | None:
    """The mode from --speculative (absent: "auto" with --draft-model, else off; None: off), checked against the
    draft flags before any model loads."""
    mode = args.speculative or ("auto" if args.draft_model else "off")
    if mode == "draft" and args.draft_model is None:
        raise RooflineError("--speculative draft needs --draft-model MODEL: a small model with the model's tokenizer "
                            "(or use prompt-lookup or self, which need no other model)")
    return None if mode == "off" else mode


def _serve_other_rank(args: argparse.Namespace) -> int | None:
    """--distributed: every rank but 0 serves rank 0's plans here, then ends the process with its exit status;
    rank 0 runs the command (None)."""
    mode = getattr(args, "distributed", None)
    if mode is None or args.command not in ("generate", "serve", "chat", "bench"):
        return None
    from mlx_engine import distributed

    distributed.check_mode(mode)
    rank = distributed.launched_rank()
    if rank is None:
        raise RooflineError(distributed.NO_LAUNCHER)
    if rank == 0:
        distributed.stop_on_sigterm(0)
        return None
    options = {k: v for k, v in _load_options(args).items() if k != "distributed"}
    model = getattr(args, "model", None)
    model = model[0] if isinstance(model, list) and model else (None if isinstance(model, list) else model)
    distributed.exit_now(distributed.serve_rank(model, mode, **options))


def _load_options(args: argparse.Namespace) -> dict[str, Any]:
    """Engine.load's options from --kv-bits / --block-size (absent: the defaults), --chat-template and
    --draft-model / --draft-bits."""
    out: dict[str, Any] = {}
    if getattr(args, "draft_model", None) is not None:
        from mlx_engine.loading import resolve

        try:  # before the main model loads (seconds), not after
            resolve(args.draft_model)
        except RooflineError as e:
            raise RooflineError(f"--draft-model: {e}") from None
        out["draft_model"] = args.draft_model
    if getattr(args, "draft_bits", None) is not None:
        if args.draft_model is None:
            raise RooflineError(f"--draft-bits {args.draft_bits} needs --draft-model MODEL: the model to hold at "
                                f"{args.draft_bits} bits as the draft (it may be the model itself)")
        out["draft_bits"] = args.draft_bits
    if getattr(args, "chat_template", None) is not None:
        out["chat_template"] = args.chat_template
    if getattr(args, "kv_bits", None) is not None:
        out["kv_bits"] = args.kv_bits
    if getattr(args, "block_size", 16) != 16:
        out["block_size"] = args.block_size
    if getattr(args, "distributed", None) is not None:
        out["distributed"] = args.distributed
    if getattr(args, "max_context", None) is not None:
        out["max_context"] = args.max_context
    return out


def cmd_bench(args: argparse.Namespace) -> int:
    from app.bench import cmd_bench

    return cmd_bench(args)


def cmd_parity(args: argparse.Namespace) -> int:
    from app.parity_cmd import cmd_parity

    return cmd_parity(args)


def cmd_chat(args: argparse.Namespace) -> int:
    from app.tui import run

    options = {**_load_options(args), **runner_options(args)}
    if "distributed" in options:
        _own_terminal()
    if "draft_model" in options:  # a model picked in the app need not suit the draft: then it loads without one
        options["draft_optional"] = True
    if getattr(args, "reasoning_effort", None) is not None:  # `roofline` alone has no such argument
        options["reasoning_effort"] = args.reasoning_effort
    return run(args.model, **options)


def _own_terminal() -> None:
    """Rank 0 of `chat` under mlx.launch: its stdin and stdout are the launcher's pipes, so the app takes the
    terminal itself (start mlx.launch with `< /dev/null`, so that the launcher does not read the keys too)."""
    if sys.stdout.isatty():
        return
    try:
        tty = os.open("/dev/tty", os.O_RDWR)
    except OSError:
        raise RooflineError("chat --distributed needs a terminal for rank 0: run it on the host you sit at, or use "
                            "serve --distributed and a client") from None
    for fd in (0, 1):
        os.dup2(tty, fd)
    os.close(tty)


def _response_format(args: argparse.Namespace) -> ResponseFormat | None:
    if args.json_object:
        return ResponseFormat("json_object")
    if args.regex is not None:
        return ResponseFormat("regex", pattern=args.regex)
    if args.json_schema is None:
        return None
    path = Path(args.json_schema)
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise RooflineError(f"--json-schema {path}: cannot read it ({e.strerror or e})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise RooflineError(f"--json-schema {path}: not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise RooflineError(f"--json-schema {path}: expected a JSON Schema object, got {type(schema).__name__}")
    return ResponseFormat("json_schema", schema=schema)


def cmd_generate(args: argparse.Namespace) -> int:
    fmt = _response_format(args)
    if fmt is not None:  # a regex or schema llguidance cannot compile fails now, not after the model loads
        from mlx_engine.structured import check_format

        check_format(fmt)
    options = {**_load_options(args), **runner_options(args)}
    sampling = SamplingParams(
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
        response_format=fmt,
        speculative=_speculative(args),
        num_draft_tokens=args.num_draft_tokens,
        reasoning_budget=args.reasoning_budget,
    )
    if args.raw:
        request = GenerationRequest(prompt=args.prompt, sampling=sampling)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        request = GenerationRequest(messages=messages, sampling=sampling, reasoning_effort=args.reasoning_effort)
    engine = load_engine(args.model, no_tokenizer="error", **options)
    parts: list[str] = []
    thoughts: list[str] = []
    final = None
    thinking = _Thinking(show=not args.json and not args.hide_reasoning)
    try:
        for event in engine.generate(request):
            parts.append(event.text)
            thoughts.append(event.reasoning)
            thinking.write(event.reasoning)
            if not args.json and event.text:
                thinking.end()
                sys.stdout.write(event.text)
                sys.stdout.flush()
            if event.done:
                final = event
    finally:
        thinking.end()
    assert final is not None
    if final.finish_reason == "error":
        return _fail(f"generation failed: {final.error}")
    usage, stats = final.usage, final.stats
    if args.json:
        out = {
            "model": engine.info.name,
            "backend": engine.info.backend,
            "device": engine.info.device,
            "text": "".join(parts),
            "reasoning": "".join(thoughts),
            "finish_reason": final.finish_reason,
            "usage": {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                      "cached_prompt_tokens": usage.cached_prompt_tokens, "reasoning_tokens": usage.reasoning_tokens},
            "stats": {"ttft_s": stats.ttft_s, "prefill_tps": stats.prefill_tps, "decode_tps": stats.decode_tps,
                      "peak_memory_bytes": stats.peak_memory_bytes, "target_forwards": stats.target_forwards,
                      "acceptance_rate": stats.acceptance_rate, "mean_accepted_tokens": stats.mean_accepted_tokens},
        }
        print(json.dumps(out, ensure_ascii=False))
    else:
        print()
        print(
            f"[{final.finish_reason}] prompt {usage.prompt_tokens} tok, reply {usage.completion_tokens} tok"
            + (f" ({usage.reasoning_tokens} reasoning)" if usage.reasoning_tokens else "")
            + f" | {engine.info.runs_on} | "
            f"ttft {stats.ttft_s * 1000:.0f} ms | prefill {stats.prefill_tps:.1f} tok/s | "
            f"decode {stats.decode_tps:.1f} tok/s | peak {stats.peak_memory_bytes / 2**20:.0f} MiB"
            + (f" | drafts: {stats.acceptance_rate:.0%} accepted, {stats.mean_accepted_tokens:.1f} a verification, "
               # decode phase, as bench/speculative.py counts it: the prefill's forward gives the first token
               f"{(usage.completion_tokens - 1) / max(stats.target_forwards - 1, 1):.2f} tokens a decode forward"
               if stats.acceptance_rate is not None else ""),
            file=sys.stderr,
        )
    return 0


class _Thinking:
    """A reasoning model's thinking on stderr as it streams, apart from the answer on stdout: dimmed on a terminal
    (plain where NO_COLOR is set), and a line of its own before the answer."""

    def __init__(self, show: bool):
        self.show = show
        self.dim = sys.stderr.isatty() and not os.environ.get("NO_COLOR")
        self.open = False

    def write(self, text: str) -> None:
        if not self.show or not text:
            return
        if not self.open and self.dim:
            sys.stderr.write("\x1b[2m")
        self.open = True
        sys.stderr.write(text)
        sys.stderr.flush()

    def end(self) -> None:
        if self.open:
            sys.stderr.write(("\x1b[0m" if self.dim else "") + "\n")
            sys.stderr.flush()
            self.open = False


if __name__ == "__main__":
    sys.exit(main())
