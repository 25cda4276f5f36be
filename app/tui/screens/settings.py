"""Per-chat settings: system prompt, sampling, speculative decoding and a reasoning model's thinking effort,
validated by the engine's SamplingParams."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, VerticalScroll
from textual.screen import ModalScreen
from textual.suggester import SuggestFromList
from textual.widgets import Button, Input, Label, Static, TextArea

from mlx_engine.api import SPECULATIVE_MODES, RequestError, SamplingParams

from app.tui.store import ChatSettings
from app.tui.thinking import EFFORT_CHOICES, effort_label, parse_effort

# (field, label, Input type, help)
FIELDS = [
    ("temperature", "Temperature", "number", "0 = greedy"),
    ("top_p", "Top-p", "number", "(0, 1]; 1 = off"),
    ("top_k", "Top-k", "integer", "0 = off"),
    ("min_p", "Min-p", "number", "[0, 1); 0 = off"),
    ("repetition_penalty", "Repetition penalty", "number", "1 = off"),
    ("max_tokens", "Max tokens", "integer", "reply length cap"),
    ("seed", "Seed", "integer", "empty = random"),
    ("speculative", "Speculative", "text", "auto/prompt-lookup/self/draft/off"),
    ("num_draft_tokens", "Draft tokens", "integer", "most per verification, 1-16"),
    ("reasoning_effort", "Thinking", "text", "/".join(EFFORT_CHOICES)),
]
NO_REASONING = "this model does not reason"  # the thinking field's hint where it is disabled
SPECULATIVE_OFF = "off"
SPECULATIVE_CHOICES = (*SPECULATIVE_MODES, SPECULATIVE_OFF)


def sampling_params(s: ChatSettings) -> SamplingParams:
    """The engine's SamplingParams for a chat's settings (raises RequestError on bad values)."""
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
                          repetition_penalty=s.repetition_penalty, max_tokens=s.max_tokens, seed=s.seed,
                          speculative=s.speculative, num_draft_tokens=s.num_draft_tokens)


class SettingsScreen(ModalScreen[ChatSettings | None]):
    """Returns the new settings on save (ctrl+s or the Save button), None on Esc."""

    DEFAULT_CSS = """
    SettingsScreen { align: center middle; }
    SettingsScreen > VerticalScroll { width: 76; max-width: 100%; height: auto; max-height: 100%; padding: 0 1;
                                       border: thick $accent; background: $surface; }
    SettingsScreen .heading { text-style: bold; margin-bottom: 1; }
    SettingsScreen TextArea { height: 5; }
    SettingsScreen Grid { grid-size: 3; grid-columns: 20 14 1fr; grid-rows: 1; grid-gutter: 0 1; height: auto;
                          margin: 1 0; }
    SettingsScreen Grid .hint { color: $text-muted; }
    SettingsScreen Grid Input { background: $boost; }
    SettingsScreen Grid Input:focus { background: $primary 30%; }
    SettingsScreen Grid Input:disabled { background: transparent; }
    SettingsScreen #error { color: $error; height: auto; }
    SettingsScreen Horizontal { height: auto; align-horizontal: right; }
    SettingsScreen Button { margin-left: 2; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save", priority=True)]
    AUTO_FOCUS = "#system_prompt"  # the first field (the default would focus the scrolling frame, nothing visible)

    def __init__(self, settings: ChatSettings, chat_title: str = "", reasons: bool = False) -> None:
        """`reasons`: the loaded model has a reasoning family, so the thinking effort applies (else it is shown
        disabled, and kept as it was)."""
        super().__init__()
        self.settings = settings
        self.chat_title = chat_title
        self.reasons = reasons

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(f"Settings for “{self.chat_title}”" if self.chat_title else "Settings for new chats",
                         classes="heading", markup=False)
            yield Label("System prompt")
            yield TextArea(self.settings.system_prompt, id="system_prompt", soft_wrap=True, tab_behavior="focus")
            with Grid():
                for name, label, kind, hint in FIELDS:
                    value = getattr(self.settings, name)
                    suggest = None
                    if name == "speculative":
                        value = SPECULATIVE_OFF if value is None else value
                        suggest = SuggestFromList(SPECULATIVE_CHOICES)
                    elif name == "reasoning_effort":
                        value = effort_label(value)
                        suggest = SuggestFromList(EFFORT_CHOICES)
                        hint = hint if self.reasons else NO_REASONING
                    yield Label(label)
                    yield Input("" if value is None else str(value), type=kind, id=name, compact=True,
                                suggester=suggest, disabled=name == "reasoning_effort" and not self.reasons)
                    yield Static(hint, classes="hint")
            yield Static("", id="error", markup=False)
            with Horizontal():
                yield Button("Cancel", id="cancel")
                yield Button("Save", id="save", variant="primary")

    def read(self) -> ChatSettings:
        """The form's settings; raises RequestError (from SamplingParams) or ValueError on bad input."""
        values: dict = {"system_prompt": self.query_one("#system_prompt", TextArea).text}
        for name, label, kind, _ in FIELDS:
            raw = self.query_one(f"#{name}", Input).value.strip()
            if name == "seed" and not raw:
                values[name] = None
                continue
            if name == "reasoning_effort":
                values[name] = parse_effort(raw) if self.reasons else self.settings.reasoning_effort
                continue
            if kind == "text":  # the speculative mode: SamplingParams says which names it knows
                values[name] = None if raw.lower() in (SPECULATIVE_OFF, "") else raw
                continue
            try:
                values[name] = int(raw) if kind == "integer" else float(raw)
            except ValueError:
                raise ValueError(f"{label}: {raw!r} is not a{'n integer' if kind == 'integer' else ' number'}") from None
        settings = ChatSettings(**values)
        sampling_params(settings)
        return settings

    def action_save(self) -> None:
        try:
            settings = self.read()
        except (RequestError, ValueError) as e:
            self.query_one("#error", Static).update(str(e))
            return
        self.dismiss(settings)

    def action_cancel(self) -> None:
        self.dismiss(None)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.action_cancel()
