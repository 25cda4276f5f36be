"""Which models a multi-model server answers to, by which names, with which defaults: the models on this machine
(`roofline models`' refs), `--alias NAME=REF`, and a `models.toml` of presets (LM Studio's per-model presets and
Ollama's Modelfile parameters, as a file):

    default = "chat"                      # what the name 'default' reaches (else the first -m, else embedded)

    [models.chat]                         # a name requests may use ...
    ref = "ollama:qwen3:4b"               # ... for this model (absent: the name is itself a ref)
    context = 8192                        # load: max context (tokens)
    kv_bits = 8                           # load: KV cache bits (4 or 8)
    draft_model = "HuggingFaceTB/SmolLM2-135M-Instruct"
    system = "You are terse."             # a system message for conversations that bring none
    temperature = 0.6                     # request defaults, where a request does not set them
    top_p = 0.9
    top_k = 40
    min_p = 0.05
    repeat_penalty = 1.1
    seed = 7
    stop = ["</answer>"]
    num_predict = 512                     # max tokens
    keep_alive = "10m"                    # seconds, "10m", "1h", or "forever"

Every error names the file and the field; a request naming a file is refused (requests never name files).
"""

from __future__ import annotations

import math
import re
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_engine.api import RooflineError

from app.server.errors import APIError, invalid

MODELS_FILE = "models.toml"
FOREVER = None  # a keep-alive of None: never unloaded for idleness
SCAN_TTL_S = 5.0  # a name not found rescans the machine's models at most this often
_LOAD = {"context": "max_context", "kv_bits": "kv_bits", "draft_model": "draft_model"}  # models.toml -> Engine.load
# models.toml's (and Ollama's options') sampling names -> the OpenAI body's
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repeat_penalty": "repetition_penalty", "seed": "seed", "stop": "stop", "num_predict": "max_tokens"}
_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m(?!s))?(?:(\d+(?:\.\d+)?)s)?(?:(\d+(?:\.\d+)?)ms)?")
NOT_FOUND_HINT = ("`roofline models` (or GET /v1/models, /api/tags here) lists the models on this machine; "
                  "`roofline pull ORG/NAME` fetches one from Hugging Face, `ollama pull NAME` through Ollama")


def config_dir() -> Path:
    from platformdirs import user_config_dir

    return Path(user_config_dir("roofline", appauthor=False))


def parse_keep_alive(v: Any, where: str) -> float | None:
    """Seconds (a number), a Go-style duration ("5m", "1h30m", "90s"), or "forever" / a negative number: never
    unloaded (None). 0 unloads as soon as the last request ends. Raises ValueError naming `where`."""
    if isinstance(v, bool):
        raise ValueError(f"{where}: expected seconds, a duration like '5m', or 'forever', got a boolean")
    if isinstance(v, (int, float)):
        if not math.isfinite(v):
            raise ValueError(f"{where}: expected a finite number of seconds, got {v}")
        return None if v < 0 else float(v)
    if isinstance(v, str):
        s = v.strip().lower()
        if s in ("forever", "-1", "inf"):
            return FOREVER
        try:
            n = float(s)
            return None if n < 0 else n
        except ValueError:
            pass
        m = _DURATION.fullmatch(s)
        if s and m and any(m.groups()):
            h, mi, sec, ms = (float(g or 0) for g in m.groups())
            return h * 3600 + mi * 60 + sec + ms / 1000
        if s.startswith("-") and _DURATION.fullmatch(s[1:]):
            return FOREVER
    raise ValueError(f"{where}: expected seconds, a duration like '5m' or '1h', or 'forever', got {v!r}")


@dataclass(frozen=True)
class Preset:
    """A name requests may use: the model it reaches and its defaults."""

    name: str
    ref: str
    load: dict[str, Any] = field(default_factory=dict)  # Engine.load options
    sampling: dict[str, Any] = field(default_factory=dict)  # models.toml names: temperature, num_predict, ...
    system: str | None = None
    keep_alive: float | None | str = "server"  # "server": the server's --keep-alive


def _check(name: str, key: str, v: Any, where: str) -> Any:
    """One preset field, type-checked; `where` is the file, for the message."""
    at = f"{where}: models.{name}.{key}"
    ints = {"context": 1, "top_k": 0, "num_predict": 1, "seed": None}
    if key in ints:
        if isinstance(v, bool) or not isinstance(v, int) or (ints[key] is not None and v < ints[key]):
            raise RooflineError(f"{at}: expected an integer" + (f" >= {ints[key]}" if ints[key] is not None else "")
                                + f", got {v!r}")
    elif key == "kv_bits":
        if v not in (4, 8) or isinstance(v, bool):
            raise RooflineError(f"{at}: expected 4 or 8, got {v!r}")
    elif key in ("temperature", "top_p", "min_p", "repeat_penalty"):
        lo, hi = {"temperature": (0, 2), "top_p": (0, 1), "min_p": (0, 1), "repeat_penalty": (0, 2**31)}[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
            raise RooflineError(f"{at}: expected a number in [{lo}, {hi}], got {v!r}")
    elif key == "stop":
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not v or len(v) > 4 or not all(isinstance(s, str) and s for s in v):
            raise RooflineError(f"{at}: expected a string or an array of 1 to 4 non-empty strings, got {v!r}")
    elif key == "keep_alive":
        try:
            return parse_keep_alive(v, at)
        except ValueError as e:
            raise RooflineError(str(e)) from None
    elif key in ("ref", "system", "draft_model"):
        if not isinstance(v, str) or not v:
            raise RooflineError(f"{at}: expected a non-empty string, got {v!r}")
    else:
        known = ", ".join(["ref", "system", "keep_alive", *_LOAD, *SAMPLING])
        raise RooflineError(f"{at}: unknown field (expected one of {known})")
    return v


def read_models_file(path: Path) -> tuple[dict[str, Preset], str | None]:
    """models.toml -> (presets by name, the `default` name or None). A missing file is no presets."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}, None
    except (OSError, UnicodeDecodeError) as e:
        raise RooflineError(f"{path}: cannot read ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise RooflineError(f"{path}: not valid TOML ({e})") from None
    unknown = [k for k in data if k not in ("default", "models")]
    if unknown:
        raise RooflineError(f"{path}: unknown top-level field {unknown[0]!r} (expected 'default' and [models.NAME] "
                            "tables)")
    default = data.get("default")
    if default is not None and (not isinstance(default, str) or not default):
        raise RooflineError(f"{path}: default: expected a model name, got {default!r}")
    models = data.get("models", {})
    if not isinstance(models, dict):
        raise RooflineError(f"{path}: models: expected tables like [models.NAME]")
    out = {}
    for name, table in models.items():
        if not isinstance(table, dict):
            raise RooflineError(f"{path}: models.{name}: expected a table of fields (ref, context, temperature, ...)")
        checked = {k: _check(name, k, v, str(path)) for k, v in table.items()}
        out[name] = Preset(name, checked.get("ref", name),
                           {_LOAD[k]: v for k, v in checked.items() if k in _LOAD},
                           {k: v for k, v in checked.items() if k in SAMPLING}, checked.get("system"),
                           checked.get("keep_alive", "server"))
    return out, default


def parse_aliases(pairs: Sequence[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, eq, ref = pair.partition("=")
        if not eq or not name.strip() or not ref.strip():
            raise RooflineError(f"--alias {pair!r}: expected NAME=REF, like chat=ollama:qwen3:4b")
        out[name.strip()] = ref.strip()
    return out


def names_a_file(name: str) -> bool:
    """Whether a request's model name is a filesystem path (refused: requests never name files). A HF id
    (ORG/NAME) is not one; an absolute, home or relative path, or a GGUF file name, is."""
    return (name.startswith(("/", "~", "./", "../", "\\")) or bool(re.match(r"[A-Za-z]:[\\/]", name))
            or name.lower().endswith(".gguf") or name.count("/") > 1 and not name.startswith(("lmstudio:", "ollama:")))


@dataclass(frozen=True)
class Entry:
    """A model the server may load: the name it is listed by, its ref, and what `roofline models` says of it."""

    name: str
    ref: str
    summary: Any = None  # mlx_engine.catalog.ModelSummary


class ModelTable:
    """Names -> presets: aliases and models.toml first, then the machine's models by the ref `roofline models`
    prints (an added folder by its folder name, since requests never name files), rescanned when a name is missing.
    `scan()` lists the models (blocking: headers are read); `only`: serve these refs alone (several -m)."""

    def __init__(self, scan: Callable[[], list[Any]], presets: dict[str, Preset] | None = None,
                 default: str | None = None):
        self._scan = scan
        self.presets = dict(presets or {})
        self.default = default
        self._entries: dict[str, Entry] = {}
        self._scanned_at = -math.inf

    def entries(self, fresh: bool = False) -> list[Entry]:
        """Blocking (a worker thread): every model served, presets first."""
        if fresh or time.monotonic() - self._scanned_at > SCAN_TTL_S:
            entries = {}
            for s in self._scan():
                if s.error:
                    continue
                name = Path(s.path).name if s.source == "path" else (s.ref or "embedded")
                entries[name] = Entry(name, s.ref or "embedded", s)
            self._entries, self._scanned_at = entries, time.monotonic()
        by_ref = {e.ref: e for e in self._entries.values()}
        presets = [Entry(p.name, p.ref, getattr(by_ref.get(self._ref(p.ref)), "summary", None))
                   for p in self.presets.values()]
        return presets + [e for e in self._entries.values() if e.name not in self.presets]

    def _ref(self, name: str) -> str:
        e = self._entries.get(name)
        return e.ref if e is not None else name

    def _find(self, name: str) -> Preset | None:
        if name in self.presets:
            p = self.presets[name]
            return Preset(p.name, self._ref(p.ref), p.load, p.sampling, p.system, p.keep_alive)
        for candidate in (name, f"{name}:latest", f"ollama:{name}", f"ollama:{name}:latest"):
            e = self._entries.get(candidate)
            if e is not None:  # a plain ref takes the presets written for that ref's name, if any
                return Preset(e.name, e.ref)
        return None

    def resolve(self, name: Any) -> Preset:
        """Blocking (a worker thread): the preset a request's `model` names. Raises APIError: 400 for a missing or
        non-string name or a file, 404 model_not_found for a name this machine does not have."""
        if name is None:
            raise invalid("you must provide a model parameter ('model': a name /v1/models lists, or 'default')",
                          "model", "missing_required_parameter")
        if not isinstance(name, str) or not name:
            raise invalid(f"'model' must be a model name (a string), got {name!r}", "model")
        if names_a_file(name):
            raise invalid(f"'model' {name!r} is a file path: requests never name files. Serve it under a name "
                          "(--alias NAME=PATH, or [models.NAME] ref = PATH in models.toml), or add its folder in the "
                          "app and use the name /v1/models lists", "model", "model_path_refused")
        if name == "default":
            if self.default is None:
                self.entries()
                return self._find("embedded") or Preset("embedded", "embedded")
            name = self.default
        self.entries()
        found = self._find(name)
        if found is None:
            self.entries(fresh=time.monotonic() - self._scanned_at > 1.0)
            found = self._find(name)
        if found is None:
            raise APIError(404, f"The model '{name}' is not on this machine: {NOT_FOUND_HINT}", "model",
                           "model_not_found")
        return found


def apply_defaults(body: dict[str, Any], endpoint: str, preset: Preset) -> dict[str, Any]:
    """The request body with the preset's defaults where it sets nothing itself: sampling (in the endpoint's own
    field names) and a system message for a conversation that brings none."""
    if not preset.sampling and preset.system is None:
        return body
    out = dict(body)
    names = dict(SAMPLING)
    if endpoint == "messages":
        names.update(stop="stop_sequences", num_predict="", min_p="", repeat_penalty="", seed="")
    elif endpoint == "responses":
        names.update(num_predict="max_output_tokens", stop="", top_k="", min_p="", repeat_penalty="", seed="")
    for key, v in preset.sampling.items():
        field_name = names.get(key, "")
        if field_name and out.get(field_name) is None and not (field_name == "max_tokens"
                                                              and out.get("max_completion_tokens") is not None):
            out[field_name] = v
    if preset.system is not None:
        if endpoint == "chat" and isinstance(out.get("messages"), list) and not any(
                isinstance(m, dict) and m.get("role") in ("system", "developer") for m in out["messages"]):
            out["messages"] = [{"role": "system", "content": preset.system}, *out["messages"]]
        elif endpoint == "messages" and out.get("system") is None:
            out["system"] = preset.system
        elif endpoint == "generate" and out.get("system") is None:
            out["system"] = preset.system
        elif endpoint == "responses" and out.get("instructions") is None:
            out["instructions"] = preset.system
    return out
