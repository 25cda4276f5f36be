"""Roofline's own environment variables (ROOFLINE_*) that the engine reads, in one place, each with what it does:
what a test run, a benchmark or a deployment sets for a whole process. What a user chooses per model is a load
option (`mlx_engine.api.LOAD_OPTIONS`). The torch backend's are in `backends/torch/switches.py`; the ecosystem's own
variables (HF_HOME, OLLAMA_MODELS, the launcher's MLX_RANK) are read where their convention is kept. Each is read
when asked, not at import, so a test's monkeypatch.setenv applies to the next use."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    name: str
    help: str

    def raw(self) -> str:
        """Its value, stripped ("" where unset)."""
        return os.environ.get(self.name, "").strip()


CACHE_DIR = Variable("ROOFLINE_CACHE_DIR", "where the engine keeps what it measures or reads once between runs (header "
                     "summaries, cost curves, compiled graphs); default: platformdirs' user cache dir")
SKIP_MEMORY_CHECK = Variable("ROOFLINE_SKIP_MEMORY_CHECK", "1, true or yes: load a model even where its weights and KV "
                             "do not fit in what this machine can give (the check `catalog.check_fit` makes)")
CPU_FP32_WEIGHTS = Variable("ROOFLINE_CPU_FP32_WEIGHTS", "auto (default), on or off: MLX's CPU backend keeps float32 "
                            "copies of the weights for numpy's BLAS (auto: where they fit in a share of the free RAM)")
DISTRIBUTED_TIMEOUT = Variable("ROOFLINE_DISTRIBUTED_TIMEOUT", "seconds rank 0 waits on another rank before it names "
                               "it and stops the run (default 30)")
PIPELINE_MICRO_BATCHES = Variable("ROOFLINE_PIPELINE_MICRO_BATCHES", "micro-batches a pipelined forward may be cut "
                                  "into (default: one per rank; 1: never cut, to measure what they gain)")
PIPELINE_DECODE_ROWS = Variable("ROOFLINE_PIPELINE_DECODE_ROWS", "sequences each micro-batch of a pipelined decode "
                                "step needs (to measure where cutting pays)")
PIPELINE_IN_FLIGHT = Variable("ROOFLINE_PIPELINE_IN_FLIGHT", "1: a decode step of each group of sequences in flight on "
                              "the pipeline; 0 (default): every rank in lockstep")
VARIABLES = (CACHE_DIR, SKIP_MEMORY_CHECK, CPU_FP32_WEIGHTS, DISTRIBUTED_TIMEOUT, PIPELINE_MICRO_BATCHES,
             PIPELINE_DECODE_ROWS, PIPELINE_IN_FLIGHT)
