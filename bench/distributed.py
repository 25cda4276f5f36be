"""Two hosts simulated in network namespaces: decode tokens/s of pipeline and tensor parallel against the link's
bandwidth, beside the link's roof (docs/benchmarks/distributed.md, issue 25).

    sudo python bench/distributed.py --rates 1mbit,10mbit,100mbit,off [--model PATH] [--markdown]

Needs root (ip netns, veth, tc). For each rate it makes two namespaces joined by a veth pair (addresses in
10.231.N.0/24, inside those namespaces only), limits both ends with a tc token bucket, and starts the two ranks with
mlx.launch from a hostfile whose ring addresses are the namespaces' (each rank enters its namespace with `ip netns
exec`); mlx.launch itself stays outside. One process without a network runs the same requests for the baseline.
Every namespace is removed on the way out. Without --model it builds a random llama (8 layers, hidden 512, 8 heads)
whose heads split in two, so both modes run the same model.

`rank` is what each rank runs: rank 0 times greedy decoding at each batch size and writes JSON with the engine's
kv_stats (each rank's weights, KV and traffic; the measured link).

    python bench/distributed.py loopback --batches 2,4,8,16 --rounds 3 [--model PATH] [--markdown]

`loopback` needs no root: two ranks on 127.0.0.1 (`mlx.launch --backend ring -n 2 --hosts 127.0.0.1`), the
pipeline's decode with each group's step in flight against lockstep (ROOFLINE_PIPELINE_IN_FLIGHT=0), the two
launched in turn for `--rounds` rounds, so that a spell of load on a shared machine falls on both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rank_main(args: argparse.Namespace) -> int:
    from mlx_engine import Engine, GenerationRequest, SamplingParams

    options = {} if args.mode == "single" else {"distributed": args.mode}
    # every batch runs at once (max_seqs); on a rank other than 0 this serves rank 0 and ends the process
    engine = Engine.load(args.model, max_seqs=max(args.batches), **options)
    rng = random.Random(0)
    vocab = engine.info.vocab_size
    stats = engine.kv_stats()  # (measures the link, once)

    def busy() -> tuple[list[float], int, list[float]]:
        """Each rank's busy seconds, rank 0's forwards cut into micro-batches, each rank's process CPU seconds."""
        if args.mode == "single":
            return [], 0, []
        ranks = engine.kv_stats()["ranks"]
        return [r["busy_s"] for r in ranks], ranks[0]["micro_batched_forwards"], [r["cpu_s"] for r in ranks]

    def timed(batch: int, prompt: int, new: int) -> tuple[list, float, list[float], int, list[float]]:
        prompts = [[rng.randrange(3, vocab) for _ in range(prompt)] for _ in range(batch)]
        sampling = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        (before, cut, cpu), t = busy(), time.perf_counter()
        streams = [engine.generate(GenerationRequest(prompt_token_ids=p, sampling=sampling)) for p in prompts]
        finals = [[e for e in s][-1] for s in streams]
        wall = time.perf_counter() - t
        after, cut_after, cpu_after = busy()
        return (finals, wall, [(a - b) / wall for a, b in zip(after, before)], cut_after - cut,
                [a - b for a, b in zip(cpu_after, cpu)])

    rows = []
    for batch in args.batches:
        timed(batch, 16, 4)  # warm-up
        finals, wall, util, cut, cpu = timed(batch, 16, args.tokens)
        tps = sum(f.stats.decode_tps for f in finals)
        rows.append({"test": f"tg{args.tokens}", "batch": batch, "tps": tps, "busy": util, "micro_batched": cut,
                     "step_ms": 1000 * batch / tps if tps else None, "wall_tps": batch * args.tokens / wall,
                     "cpu_ms_per_token": [1000 * c / (batch * args.tokens) for c in cpu]})
    timed(3, args.prompt, 1)
    finals, wall, util, cut, _ = timed(3, args.prompt, 1)  # three prompts in one packed forward: micro-batches apply
    rows.append({"test": f"pp{args.prompt}", "batch": 3, "tps": 3 * args.prompt / wall, "busy": util,
                 "micro_batched": cut})
    stats = engine.kv_stats()
    out = {"mode": args.mode, "rows": rows, "weight_bytes": engine.info.weight_bytes, "link": stats.get("link"),
           "ranks": stats.get("ranks"), "model": engine.info.name}
    engine.close()
    Path(args.out).write_text(json.dumps(out))
    return 0


def rate_bits(rate: str) -> float:
    """tc's rate syntax (10mbit, 1gbit, 500kbit) in bits/s."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise SystemExit(f"--rates {rate!r}: expected tc's rate syntax, e.g. 10mbit, 1gbit, or off")


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


class Namespaces:
    """Two namespaces joined by a veth pair, each end limited to `rate` (None: unlimited)."""

    def __init__(self, rate: str | None, delay_ms: float):
        tag = f"{os.getpid() % 10000}{random.randrange(100)}"
        self.names = [f"rl25a{tag}", f"rl25b{tag}"]
        self.subnet = random.randrange(1, 250)
        self.ips = [f"10.231.{self.subnet}.1", f"10.231.{self.subnet}.2"]
        self.rate, self.delay_ms = rate, delay_ms

    def __enter__(self) -> Namespaces:
        a, b = self.names
        for ns in self.names:
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "link", "add", "veth0", "netns", a, "type", "veth", "peer", "name", "veth1", "netns", b)
        for ns, dev, ip in ((a, "veth0", self.ips[0]), (b, "veth1", self.ips[1])):
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            if self.rate:
                # token bucket at `rate`, a burst of 4 ms of it (at least 2 KB: tbf needs a packet's worth) and a
                # 200 ms queue
                burst = max(2048, int(rate_bits(self.rate) / 8 / 250))
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate",
                   self.rate, "burst", str(burst), "latency", "200ms")
            if self.delay_ms:
                parent = ["parent", "1:1"] if self.rate else ["root"]
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, *parent, "handle", "10:", "netem",
                   "delay", f"{self.delay_ms}ms")
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def launch_in(ns: Namespaces, mode: str, model: str, out: Path, args: argparse.Namespace) -> dict:
    """`mode`: pipeline, tensor, pipeline:M (at most M micro-batches a forward), or pipeline:flight (each group's
    decode step in flight, ROOFLINE_PIPELINE_IN_FLIGHT=1)."""
    hostfile = out.with_suffix(".hosts.json")
    hostfile.write_text(json.dumps({"backend": "ring", "hosts": [{"ssh": "127.0.0.1", "ips": [ip]} for ip in ns.ips]}))
    name, _, micro = mode.partition(":")
    rank_cmd = " ".join([sys.executable, str(Path(__file__).resolve()), "rank", "--mode", name, "--model", model,
                         "--out", str(out), "--tokens", str(args.tokens), "--prompt", str(args.prompt), "--batches",
                         ",".join(map(str, args.batches))])
    names = " ".join(ns.names)
    script = f"names=({names}); exec ip netns exec ${{names[$MLX_RANK]}} {rank_cmd}"
    launcher = Path(sys.executable).parent / "mlx.launch"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    env["PYTHONPATH"] = str(ROOT)
    # a forward's messages on a slow link outlast the default deadline (30 s): this bench waits for them
    extra = ["--env", "ROOFLINE_DISTRIBUTED_TIMEOUT=600"]
    if micro == "flight":
        extra += ["--env", "ROOFLINE_PIPELINE_IN_FLIGHT=1"]
    elif micro:
        extra += ["--env", f"ROOFLINE_PIPELINE_MICRO_BATCHES={micro}"]
    p = subprocess.run([str(launcher), "--hostfile", str(hostfile), "-p", str(random.randrange(30000, 60000)), *extra,
                        "--", "bash", "-c", script], capture_output=True, text=True, env=env, timeout=args.timeout)
    if not out.exists():
        raise RuntimeError(f"{mode} at {ns.rate}: no result (rc {p.returncode})\n{p.stderr[-3000:]}")
    return json.loads(out.read_text())


def make_model(folder: Path, vocab: int = 8192) -> Path:
    from tests.support.tiny_models import random_llama_folder

    return random_llama_folder(folder, num_heads=8, num_kv_heads=4, head_dim=64, hidden=512, layers=8, vocab=vocab,
                               context=2048)


def driver(args: argparse.Namespace) -> int:
    from mlx_engine.distributed.plan import link_roof

    tmp = Path(tempfile.mkdtemp(prefix="rl25-"))
    model = args.model or str(make_model(tmp / "model"))
    single = tmp / "single.json"
    subprocess.run([sys.executable, __file__, "rank", "--mode", "single", "--model", model, "--out", str(single),
                    "--tokens", str(args.tokens), "--prompt", str(args.prompt), "--batches",
                    ",".join(map(str, args.batches))], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                   timeout=args.timeout)
    base = json.loads(single.read_text())
    table = []
    for rate in args.rates:
        for mode in args.modes:
            with Namespaces(None if rate == "off" else rate, args.delay_ms) as ns:
                res = launch_in(ns, mode, model, tmp / f"{mode.replace(':', '-')}-{rate}.json", args)
            r0 = res["ranks"][0]
            for row, ref in zip(res["rows"], base["rows"]):
                roof = link_roof(res["link"], mode.partition(":")[0], len(res["ranks"]), r0["model_layers"],
                                 r0["hidden"], r0["itemsize"], row["batch"], r0["plan_bytes"] / max(1, r0["forwards"]))
                table.append({"rate": rate, "mode": mode, **row, "single_tps": ref["tps"], **res["link"], **roof,
                              "weights": [r["weight_bytes"] for r in res["ranks"]]})
                print(json.dumps(table[-1]), file=sys.stderr, flush=True)
    print(markdown(table, base, args))
    return 0


def loopback(args: argparse.Namespace) -> int:
    """In flight against lockstep, two ranks on loopback, launched in turn."""
    import statistics

    tmp = Path(tempfile.mkdtemp(prefix="rl25-loop-"))
    model = args.model or str(make_model(tmp / "model", vocab=1024))
    launcher = Path(sys.executable).parent / "mlx.launch"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    env["PYTHONPATH"] = str(ROOT)
    runs: dict[str, list[dict]] = {"lockstep": [], "in flight": []}
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for name, flag in (("lockstep", "0"), ("in flight", "1"))[:: 1 if r % 2 == 0 else -1]:
            out = tmp / f"{name.replace(' ', '-')}-{r}.json"
            cmd = [str(launcher), "--backend", "ring", "-n", "2", "--hosts", "127.0.0.1", "-p",
                   str(random.randrange(30000, 60000)), "--env", f"ROOFLINE_PIPELINE_IN_FLIGHT={flag}", "--",
                   sys.executable, str(Path(__file__).resolve()), "rank", "--mode", "pipeline", "--model", model,
                   "--out", str(out), "--tokens", str(args.tokens), "--prompt", str(args.prompt), "--batches",
                   ",".join(map(str, args.batches))]
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
            if not out.exists():
                raise RuntimeError(f"{name}: no result (rc {p.returncode})\n{p.stderr[-3000:]}")
            runs[name].append(json.loads(out.read_text()))
            loads.append(os.getloadavg()[0])
            print(name, r, json.dumps([(x["batch"], round(x["tps"], 1)) for x in runs[name][-1]["rows"]]),
                  file=sys.stderr, flush=True)
    lines = [f"{runs['lockstep'][0]['model']} float32 on MLX's CPU backend, greedy, {args.tokens} new tokens after "
             f"16-token prompts, medians of {args.rounds} launches each (best / best: the fastest of each), launched "
             f"in turn; load average (1 min) {min(loads):.1f}-{max(loads):.1f} over the run; "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             "", "| sequences | lockstep tok/s | in flight tok/s | in flight / lockstep | best / best | lockstep busy "
             "(rank 0 / 1) | in flight busy (rank 0 / 1) | CPU ms/token lockstep (rank 0 / 1) | in flight |",
             "|---:|---:|---:|---:|---:|---|---|---|---|"]

    def med(name: str, i: int, key: str) -> float:
        return statistics.median(run["rows"][i][key] for run in runs[name])

    def per_rank(name: str, i: int, key: str, form: str) -> str:
        return " / ".join(format(statistics.median(run["rows"][i][key][k] for run in runs[name]), form)
                          for k in range(2))

    def best(name: str, i: int) -> float:
        return max(run["rows"][i]["tps"] for run in runs[name])

    for i, batch in enumerate(args.batches):
        a, b = med("lockstep", i, "tps"), med("in flight", i, "tps")
        ratio = best("in flight", i) / best("lockstep", i)
        cells = [per_rank(name, i, key, form) for key, form in (("busy", ".0%"), ("cpu_ms_per_token", ".1f"))
                 for name in ("lockstep", "in flight")]
        lines.append(f"| {batch} | {a:.1f} | {b:.1f} | {b / a:.2f} | {ratio:.2f} | {' | '.join(cells)} |")
    print("\n".join(lines))
    (tmp / "runs.json").write_text(json.dumps(runs))
    print(f"(each launch's figures: {tmp / 'runs.json'})", file=sys.stderr)
    return 0


def markdown(table: list[dict], base: dict, args: argparse.Namespace) -> str:
    load = os.getloadavg()
    lines = [f"{base['model']} float32 on MLX's CPU backend, greedy; load average {load[0]:.1f} / {load[1]:.1f} "
             f"(1 / 5 min) at the end; {time.strftime('%Y-%m-%d')}", "",
             "| link (tc rate) | mode | test | batch | measured link | latency (one way) | bytes/token | "
             "link roof: bandwidth | link roof: with latency | tok/s | one process tok/s | ranks busy |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in table:
        roof = (f"{r['bandwidth_roof_tps']:,.0f} | {r['latency_roof_tps']:,.0f}" if r["test"].startswith("tg")
                else "- | -")
        lines.append(f"| {r['rate']} | {r['mode']} | {r['test']} | {r['batch']} | "
                     f"{r['bandwidth_bytes_s'] * 8 / 1e6:,.1f} Mbit/s | {r['latency_s'] * 1e3:.2f} ms | "
                     f"{r['bytes_per_token']:,.0f} | {roof} | {r['tps']:.1f} | {r['single_tps']:.1f} | "
                     f"{' / '.join(f'{b:.0%}' for b in r['busy'])} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = p.add_subparsers(dest="command")
    r = sub.add_parser("rank")
    r.add_argument("--mode", required=True, choices=("single", "pipeline", "tensor"))
    r.add_argument("--model", required=True)
    r.add_argument("--out", required=True)
    lo = sub.add_parser("loopback", help="in flight against lockstep, two ranks on loopback (no root)")
    lo.add_argument("--model")
    lo.add_argument("--rounds", type=int, default=3)
    lo.add_argument("--timeout", type=float, default=300)
    for q in (p, r, lo):
        q.add_argument("--tokens", type=int, default=32, help="tokens generated per request (default 32)")
        q.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
        q.add_argument("--prompt", type=int, default=128, help="tokens of each of the 3 prompts prefilled together")
    p.add_argument("--rates", type=lambda s: s.split(","), default=["1mbit", "10mbit", "100mbit", "off"])
    p.add_argument("--modes", type=lambda s: s.split(","), default=["pipeline", "pipeline:1", "tensor"],
                   help="pipeline, tensor, pipeline:M (at most M micro-batches a forward; pipeline:1 never cuts), "
                        "pipeline:flight (each group's decode step in flight)")
    p.add_argument("--model")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay added on each end (tc netem)")
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args()
    if args.command == "rank":
        return rank_main(args)
    if args.command == "loopback":
        return loopback(args)
    if os.geteuid() != 0:
        print("bench/distributed.py: needs root for ip netns and tc (run it with sudo)", file=sys.stderr)
        return 2
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
