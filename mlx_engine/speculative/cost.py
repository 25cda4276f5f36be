"""The cost model: a target forward's cost by width relative to a decode step, T(w)/T(1), measured once per
model, backend and machine and kept on disk; and the k it predicts pays best."""

from __future__ import annotations

import json
import math
import os
import platform
from dataclasses import dataclass, field

import mlx.core as mx

from mlx_engine.backends.base import PhaseForwards
from mlx_engine.paths import cache_dir
from mlx_engine.speculative.accept import expected_tokens

AUTO_MARGIN = 0.1  # "auto" speculates only where it predicts at least this gain over plain decoding


@dataclass
class CostCurve:
    """T(w) / T(1) of a target forward over w new tokens (w = k + 1), measured at some widths."""

    ratios: dict[int, float]
    t1_s: float = 0.0
    draft_costs: dict[str, float] = field(default_factory=dict)  # proposer -> T_draft(1) / T(1)

    def cost(self, width: int) -> float:
        """T(width)/T(1), interpolated between measured widths, past the widest along the last slope. Not forced
        to grow with the width: on the torch CPU backend a forward over 4 rows can be cheaper than over 2 or 3 (one
        thread's float32 matmul; docs/benchmarks/code-figures.md, "Measurements moved out of the code"), so a dip in the
        curve is a width worth drafting to, not noise to smooth over."""
        ws = sorted(self.ratios)
        if width in self.ratios:
            return self.ratios[width]
        lo = max((w for w in ws if w < width), default=ws[0])
        hi = min((w for w in ws if w > width), default=None)
        if hi is None:  # extrapolate with the last slope
            a, b = ws[-2], ws[-1]
            return self.ratios[b] + (self.ratios[b] - self.ratios[a]) / (b - a) * (width - b)
        f = (width - lo) / (hi - lo)
        return self.ratios[lo] + f * (self.ratios[hi] - self.ratios[lo])

    def best_k(self, alpha: float, k_max: int, draft_cost: float = 0.0, margin: float = AUTO_MARGIN,
               max_loss: float = math.inf) -> int:
        """The k with the best predicted speedup E[tokens] / cost, or 0 when none beats plain by `margin`. Only k
        whose worst case (its first draft rejected: one token for the whole verification) loses at most
        `max_loss` plain steps count."""
        return self.best(alpha, k_max, draft_cost, margin, max_loss)[0]

    def best(self, alpha: float, k_max: int, draft_cost: float = 0.0, margin: float = AUTO_MARGIN,
             max_loss: float = math.inf) -> tuple[int, float]:
        """`best_k` and its predicted speedup (1.0 with k = 0)."""
        best, best_gain = 0, 1.0 + margin
        for k in range(1, k_max + 1):
            cost = self.cost(k + 1) + k * draft_cost
            gain = expected_tokens(alpha, k) / cost
            if gain > best_gain and cost - 1.0 <= max_loss:
                best, best_gain = k, gain
        return best, (best_gain if best else 1.0)


COST_CURVE_FILE = "cost_curves.json"
COST_CURVE_FORMAT = 2  # 2: width 4 measured too (a curve kept before is measured again)


def cost_curve_key(runner: PhaseForwards) -> str | None:
    """What a measured curve holds for: the weights (and activation dtype), the backend and device (and on
    MLX's CPU backend whether float32 host weights are resident), the machine and the MLX version. None: the runner
    has no fingerprint, so nothing is kept."""
    if not runner.fingerprint:
        return None
    info = runner.info  # float32 host weights (MLX's CPU backend), CUDA graphs: another curve (`timing_variant`)
    return "|".join([runner.fingerprint.hex(), f"{info.backend}-{info.device}{runner.timing_variant()}",
                     f"{platform.system()}-{platform.machine()}", f"mlx-{mx.__version__}"])


def load_cost_curve(key: str) -> CostCurve | None:
    """The curve measured before for `key`, or None (none kept, or the file is unreadable or malformed)."""
    try:
        raw = json.loads((cache_dir() / COST_CURVE_FILE).read_text())
        entry = raw["curves"][key] if raw.get("format") == COST_CURVE_FORMAT else None
        if entry is None:
            return None
        ratios = {int(w): float(r) for w, r in entry["ratios"].items()}
        t1_s = float(entry["t1_s"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if ratios.get(1) != 1.0 or len(ratios) < 2 or not all(math.isfinite(r) and r > 0 for r in ratios.values()):
        return None
    return CostCurve(ratios, t1_s)


def save_cost_curve(key: str, curve: CostCurve) -> None:
    """Keeps `curve` for `key` beside the others (an unreadable file is replaced); never raises."""
    path = cache_dir() / COST_CURVE_FILE
    try:
        raw = json.loads(path.read_text())
        curves = raw["curves"] if raw.get("format") == COST_CURVE_FORMAT and isinstance(raw["curves"], dict) else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        curves = {}
    curves[key] = {"ratios": {str(w): r for w, r in sorted(curve.ratios.items())}, "t1_s": curve.t1_s}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"format": COST_CURVE_FORMAT, "curves": curves}, indent=1))
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError:
        pass
