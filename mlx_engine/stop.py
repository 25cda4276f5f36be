"""Stop strings over streamed text: a stop string is never emitted, and text that might begin one is held."""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""
        self.hit: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        """Adds new text; returns (text safe to emit now, whether a stop string was reached)."""
        if not self.stops:
            return text, False
        self.held += text
        found = [(self.held.find(s), s) for s in self.stops if s in self.held]
        if found:
            idx, self.hit = min(found)
            out, self.held = self.held[:idx], ""
            return out, True
        keep = self._partial_suffix()
        out = self.held[: len(self.held) - keep]
        self.held = self.held[len(self.held) - keep :]
        return out, False

    def flush(self, text: str = "") -> str:
        """End of generation: whatever is held (plus `text`) cannot complete a stop string any more."""
        out, hit = self.feed(text)
        if hit:
            return out
        out, self.held = out + self.held, ""
        return out

    def _partial_suffix(self) -> int:
        """Length of the longest suffix of the held text that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.held)), best, -1):
                if self.held.endswith(s[:n]):
                    best = n
                    break
        return best
