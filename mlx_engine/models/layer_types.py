"""transformers' `layer_types`: which layers attend through a sliding window. Read by the config normalizer and by
mlx-lm's fixed classes alike, so it depends on neither."""

from __future__ import annotations

FULL, SLIDING = "full_attention", "sliding_attention"


def sliding_layers(layer_types: list[str] | None, num_layers: int, window: int | None,
                   default: str = "none") -> list[bool]:
    """Which layers attend through a window: from `layer_types`, else `default` ("alternate": even layers, as
    Gemma 2 and gpt-oss before transformers 5; "all"; "none"). No window: none."""
    if not window:
        return [False] * num_layers
    if layer_types:
        return [t == SLIDING for t in layer_types[:num_layers]]
    return [default == "all" or (default == "alternate" and i % 2 == 0) for i in range(num_layers)]
