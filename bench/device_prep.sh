#!/usr/bin/env bash
# Prepares what bench/device_check.sh needs on a lent H200, which reaches no network: the wheels its
# Python 3.12 lacks (MLX's CPU build for the parity reference side, mlx-lm, gguf, platformdirs, plotext;
# starlette and uvicorn for `roofline serve`; llguidance for response formats)
# and the embedded SmolLM2 GGUF, split in two parts because one device call carries at most 64 MiB.
#
# Run here:   bash bench/device_prep.sh          (writes .dev/, ignored by git through .git/info/exclude)
# Then two device calls, back to back while the machine stays warm (the first also keeps its files in
# /tmp/roofline-dev there, in case the repo's ignored paths are not kept between calls):
#   run(command="bash bench/device_check.sh tests", carry=[".dev/p1", ".dev/whl"], timeout_s=300)   # ~50 s
#   run(command="bash bench/device_check.sh",       carry=[".dev/p2"], timeout_s=540)               # ~6 min
# and, if the machine is still warm and time is left (its files are kept in /tmp/roofline-dev there):
#   run(command="bash bench/device_check.sh server", timeout_s=330)                                # issue 7
# Copy what they print into docs/benchmarks/h200.md (the files come back under $OUT; the headline figures into
# docs/benchmarks.md); then give the machine back.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.dev/' .git/info/exclude 2>/dev/null || echo '/.dev/' >> .git/info/exclude
rm -rf .dev && mkdir -p .dev/whl .dev/p1 .dev/p2
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .dev/whl \
  mlx==0.32.4 mlx-cpu==0.32.4 mlx-lm==0.32.2 gguf==0.19.0 platformdirs==4.14.9 plotext==6.1.0 \
  starlette==1.10.0 uvicorn==0.54.0 llguidance==1.9.1
gguf=$(uv run --no-sync python -c "from mlx_engine.loading import embedded_model_path as p; print(p())")
sha256sum "$gguf" | cut -d' ' -f1 > .dev/whl/smollm2.sha256
# the first call carries the wheels (15 MB) and the working tree (~6 MB) too: 40 MB of the model there, 58 MB
# in the second (each call carries at most 64 MiB)
dd if="$gguf" of=.dev/p1/smollm2.gguf.part bs=1M iflag=count_bytes count=40000000 status=none
dd if="$gguf" of=.dev/p2/smollm2.gguf.part bs=1M iflag=skip_bytes skip=40000000 status=none
du -sh .dev/*
