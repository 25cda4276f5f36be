"""The stats bar: live decode speed, latency, tokens, context, speculative decoding's acceptance, memory and % of
the memory-bandwidth roofline."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from textual.widgets import Static


def mib(n: float) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.0f} MiB" if n >= 100 * 2**20 else f"{n / 2**20:.1f} MiB"


@dataclass
class LiveStats:
    """What the bar shows; filled while a reply streams, then from the final event's usage and stats."""

    decode_tps: float = 0.0
    ttft_s: float | None = None
    prompt_tokens: int = 0
    reply_tokens: int = 0
    reasoning_tokens: int = 0  # of reply_tokens, a reasoning model's thinking (the final usage's once it ends)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (or a restored chat)
    context_length: int = 0
    weight_bytes: int = 0
    kv_bytes: int = 0
    bytes_per_token: int = 0  # read by one decode step at the current context
    bandwidth_bytes_per_s: float = 0.0
    bandwidth_label: str = ""
    streaming: bool = False
    # speculative decoding, from the final stats; None: no draft token was verified
    acceptance_rate: float | None = None  # accepted / drafted
    mean_accepted_tokens: float | None = None  # accepted draft tokens per verification
    target_forwards: int = 0
    model: str = ""  # the model whose reply these figures are ("": not known, a reply saved by an older version)

    def to_saved(self) -> dict[str, Any]:
        """A finished reply's figures as the chat store keeps them with the message (`ReplyRunner.finish`); the
        speculative ones only when drafts were verified."""
        saved: dict[str, Any] = dict(prompt_tokens=self.prompt_tokens, completion_tokens=self.reply_tokens,
                                     cached_prompt_tokens=self.cached_tokens, ttft_s=self.ttft_s,
                                     decode_tps=self.decode_tps)
        if self.acceptance_rate is not None:
            saved.update(acceptance_rate=self.acceptance_rate, mean_accepted_tokens=self.mean_accepted_tokens,
                         target_forwards=self.target_forwards)
        if self.reasoning_tokens:
            saved["reasoning_tokens"] = self.reasoning_tokens
        if self.model:
            saved["model"] = self.model
        return saved

    @classmethod
    def from_saved(cls, saved: dict[str, Any]) -> LiveStats:
        """The inverse of `to_saved`, so that a chat opened again shows its last reply's speed, tokens and context
        rather than zeros. A field that is missing or not a number (an older or damaged row) keeps its default."""

        def num(key: str) -> float | None:
            v = saved.get(key)
            return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None

        def count(key: str) -> int:
            v = num(key)
            return int(v) if v is not None and v >= 0 else 0

        return cls(decode_tps=num("decode_tps") or 0.0, ttft_s=num("ttft_s"), prompt_tokens=count("prompt_tokens"),
                   reply_tokens=count("completion_tokens"), reasoning_tokens=count("reasoning_tokens"),
                   cached_tokens=count("cached_prompt_tokens"),
                   acceptance_rate=num("acceptance_rate"), mean_accepted_tokens=num("mean_accepted_tokens"),
                   target_forwards=count("target_forwards"),
                   model=saved["model"] if isinstance(saved.get("model"), str) else "")

    @property
    def roofline_fraction(self) -> float | None:
        """bytes per decode step x tokens/s / bandwidth: how close decode runs to the memory roofline."""
        if not self.bandwidth_bytes_per_s or not self.decode_tps or not self.bytes_per_token:
            return None
        return self.bytes_per_token * self.decode_tps / self.bandwidth_bytes_per_s

    def render_line(self) -> str:
        used = self.prompt_tokens + self.reply_tokens
        speed = " │ ".join([
            f"{'▶ ' if self.streaming else ''}{self.decode_tps:.1f} tok/s",
            f"TTFT {self.ttft_s:.2f} s" if self.ttft_s is not None else "TTFT –",
            f"prompt {self.prompt_tokens}" + (f" ({self.cached_tokens:,} cached)" if self.cached_tokens else "")
            + f" · reply {self.reply_tokens}"
            + (f" ({self.reasoning_tokens} thinking)" if self.reasoning_tokens else ""),
            f"ctx {used:,}/{self.context_length:,}",
        ])
        if self.acceptance_rate is not None:
            speed += (f" │ drafted (tinted) {self.acceptance_rate * 100:.0f}% accepted · "
                      f"{self.mean_accepted_tokens or 0:.1f} per verify · {self.target_forwards:,} forwards")
        frac = self.roofline_fraction
        roof = f"{frac * 100:.1f}% of roofline" if frac is not None else "–% of roofline"
        memory = " │ ".join([
            f"model {mib(self.weight_bytes)} · KV {mib(self.kv_bytes)}",
            roof + (f" · {self.bandwidth_label}" if self.bandwidth_label else " · measuring bandwidth…"),
        ])
        return speed + "\n" + memory


# What each figure of the bar means: the help screen's "Stats bar" section and the bar's tooltip
LEGEND = [
    ("tok/s", "decode speed of the reply (▶ while it streams)"),
    ("TTFT", "time to the first token: prompt processing (prefill) and the first step"),
    ("prompt N (M cached)", "prompt tokens, M of them read from the prefix cache or the chat's saved KV"),
    ("reply N (M thinking)", "reply tokens, M of them a reasoning model's thinking (shown collapsed above the answer)"),
    ("ctx", "tokens in the context (prompt + reply) / the model's context length"),
    ("drafted (tinted)", "N% accepted: speculative decoding's share of drafted tokens the model accepted; "
                         "accepted drafted text is tinted in the reply"),
    ("N per verify", "draft tokens accepted per verification forward (each also yields one token of its own)"),
    ("N forwards", "forward passes of the model for the reply, the prompt's included: fewer than reply tokens "
                   "means drafting paid"),
    ("model · KV", "bytes of the weights and of this chat's KV cache"),
    ("% of roofline", "bytes read per decode step x tokens/s / this machine's memory bandwidth (and where that "
                      "figure comes from)"),
]


class StatsBar(Static):
    """Two fixed lines under the input (cut with an ellipsis when narrow): an update never changes the layout,
    so refreshing it every frame while streaming costs a repaint of two lines, not a reflow of the screen.
    Its tooltip (and F1) says what each figure means."""

    DEFAULT_CSS = """
    StatsBar { height: 2; padding: 0 1; background: $panel; color: $text-muted;
               text-wrap: nowrap; text-overflow: ellipsis; }
    StatsBar.-streaming { color: $text; }
    """

    def on_mount(self) -> None:
        self.tooltip = "\n".join(f"{term}: {meaning}" for term, meaning in LEGEND)

    def show(self, stats: LiveStats) -> None:
        self.set_class(stats.streaming, "-streaming")
        self.update(stats.render_line(), layout=False)
