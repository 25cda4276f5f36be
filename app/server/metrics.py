"""Counters for `GET /metrics` in Prometheus' text format (version 0.0.4), and a KV-stats reader that never
waits on a busy engine."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.count += 1
        self.sum += v
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {self.sum:.6f}")
        out.append(f"{name}_count {self.count}")
        return out


class Metrics:
    """Updated on the event loop thread only (no locks needed)."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, status) -> count
        self.finished: Counter[str] = Counter()  # finish reason -> generations
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.completion_tokens = 0
        self.running = 0  # generations submitted to the engine and not finished there (n per request of n choices)
        self.draft_accepted_tokens = 0
        self.acceptance_sum = 0.0  # per-request acceptance rates of requests that verified drafts
        self.acceptance_count = 0
        self.ttft = Histogram(TTFT_BUCKETS)

    def render(self, waiting: int, engine_waiting: int, kv: dict[str, Any] | None, kv_age_s: float | None) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(f"{name}{labels} {_num(v)}" for labels, v in samples)

        metric("roofline_requests_total", "counter", "HTTP requests answered, by route and status.",
               [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(self.requests.items())])
        metric("roofline_generations_total", "counter", "Generations the engine finished, by finish reason.",
               [(f'{{finish_reason="{r}"}}', n) for r, n in sorted(self.finished.items())])
        metric("roofline_prompt_tokens_total", "counter", "Prompt tokens of finished generations.",
               [("", self.prompt_tokens)])
        metric("roofline_cached_prompt_tokens_total", "counter", "Prompt tokens served from the prefix cache.",
               [("", self.cached_prompt_tokens)])
        metric("roofline_completion_tokens_total", "counter", "Tokens generated.", [("", self.completion_tokens)])
        metric("roofline_requests_in_flight", "gauge", "Generations submitted to the engine and not finished.",
               [("", self.running)])
        metric("roofline_queue_depth", "gauge", "Requests waiting: for an admission slot (--max-concurrency), "
               "or submitted to the engine without a first event yet.",
               [('{stage="admission"}', waiting), ('{stage="engine"}', engine_waiting)])
        if kv is not None:
            if kv.get("kind") == "paged":
                metric("roofline_kv_blocks_used", "gauge", "KV blocks held by running requests.", [("", kv["used"])])
                metric("roofline_kv_blocks_cached", "gauge", "Free KV blocks still holding a cached prefix.",
                       [("", kv["cached"])])
                metric("roofline_kv_blocks_total", "gauge", "KV blocks in the pool.", [("", kv["num_blocks"])])
            metric("roofline_prefix_cache_hit_rate", "gauge", "Prompt tokens found in the prefix cache / queried.",
                   [("", kv.get("hit_rate", 0.0))])
            metric("roofline_kv_stats_age_seconds", "gauge", "Age of the KV figures above (read between steps).",
                   [("", kv_age_s or 0.0)])
        rate = self.acceptance_sum / self.acceptance_count if self.acceptance_count else 0.0
        metric("roofline_spec_decode_acceptance_rate", "gauge", "Mean over finished requests that verified draft "
               "tokens of accepted / drafted (0 until one has).", [("", rate)])
        metric("roofline_spec_decode_accepted_tokens_total", "counter", "Generated tokens that came from accepted "
               "drafts.", [("", self.draft_accepted_tokens)])
        lines.append("# HELP roofline_time_to_first_token_seconds Request arrival to first generated token.")
        lines.append("# TYPE roofline_time_to_first_token_seconds histogram")
        lines.extend(self.ttft.lines("roofline_time_to_first_token_seconds"))
        return "\n".join(lines) + "\n"


def memory_lines(held: Any, models_loaded: int) -> str:
    """The process's memory (`mlx_engine.memory.HeldMemory`) and its loaded models, as gauges: what an unload
    gives back shows here."""
    return "".join([
        "# HELP roofline_models_loaded Models loaded now.\n# TYPE roofline_models_loaded gauge\n",
        f"roofline_models_loaded {models_loaded}\n",
        "# HELP roofline_memory_bytes The server process's memory: resident set, MLX arrays, MLX's buffer cache.\n",
        "# TYPE roofline_memory_bytes gauge\n",
        f'roofline_memory_bytes{{kind="rss"}} {held.rss_bytes}\n',
        f'roofline_memory_bytes{{kind="mlx_active"}} {held.mlx_active_bytes}\n',
        f'roofline_memory_bytes{{kind="mlx_cache"}} {held.mlx_cache_bytes}\n'])


def _num(v: float) -> str:
    return str(v) if isinstance(v, int) else f"{v:.6g}"


class KVStatsReader:
    """`engine.kv_stats()` runs on the engine thread, so it waits for the step (today: the whole generation)
    in progress. One background call at a time; a reader gets the freshest figures within `wait_s`, else
    the last ones with their age."""

    def __init__(self, fetch: Callable[[], dict[str, Any]]):
        self._fetch = fetch
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._done.set()
        self.value: dict[str, Any] | None = None
        self.at = 0.0

    def _run(self) -> None:
        try:
            value = self._fetch()
            with self._lock:
                self.value, self.at = value, time.monotonic()
        except Exception:  # noqa: BLE001 - metrics must not fail the server
            pass
        finally:
            self._done.set()

    def read(self, wait_s: float) -> tuple[dict[str, Any] | None, float | None]:
        """Blocking (call it from a worker thread): (stats, age in seconds)."""
        with self._lock:
            if self._done.is_set():
                self._done.clear()
                threading.Thread(target=self._run, name="roofline-serve-kvstats", daemon=True).start()
        self._done.wait(wait_s)
        with self._lock:
            return self.value, (time.monotonic() - self.at) if self.value is not None else None
