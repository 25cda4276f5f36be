"""The model families' own tool-call formats beyond Hermes and the JSON fallback (`tool_formats.py`): Llama 3.x's
JSON (`llama`), Mistral's `[TOOL_CALLS]` (`mistral`), Qwen3-Coder's XML (`qwen_coder`), each a `ToolFormat`
(`base`) that `tool_formats.detect` picks from the chat template's tool markup."""
