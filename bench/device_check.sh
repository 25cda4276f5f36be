#!/usr/bin/env bash
# The device check of issue 8, for one lent NVIDIA H200 (see bench/device_prep.sh for how its files get
# there). Under 5 minutes: parity of SmolLM2 between the torch backend on CUDA and the MLX engine on the
# CPU (64 greedy steps, KL per position; float16 on the GPU, then float32), the torch backend's decode at batch 1, 8, 32 and 64 as a share
# of the H200's 4.8 TB/s (CUDA graphs on, then off), and HF transformers' generate() on the same GPU as
# the peer. `device_check.sh tests` (the first of the two calls) runs the CUDA tests instead; `fusion` the
# A/B of the fused elementwise kernels; `server` bench/server.py against `roofline serve` on the GPU;
# `speculative` issue 6's bench/speculative.py on the GPU (its cost curve through the CUDA graphs, then plain,
# prompt lookup and "auto" on the edit, chat and code prompts, in rotation).
# Everything it writes goes to $OUT (the device tool brings back at most 8 files) or /tmp/device_out:
# report.txt (all it prints) and one JSON per measurement.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device_out}; mkdir -p "$OUT"
log() { echo "== $* ($(date -u +%H:%M:%S))" | tee -a "$OUT/report.txt"; }
MODEL=/tmp/smollm2.gguf
KEEP=/tmp/roofline-dev  # the carried files, kept outside the repo between the two calls
if [ -d .dev/whl ] || [ -d "$KEEP/whl" ]; then
  mkdir -p "$KEEP"
  for d in whl p1 p2; do [ -d ".dev/$d" ] && cp -r ".dev/$d" "$KEEP/"; done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$KEEP"/whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  if [ "${1:-}" != tests ]; then
    cat "$KEEP/p1/smollm2.gguf.part" "$KEEP/p2/smollm2.gguf.part" > "$MODEL" || exit 1
    [ "$(sha256sum "$MODEL" | cut -d' ' -f1)" = "$(cat "$KEEP/whl/smollm2.sha256")" ] || { echo "model parts corrupt"; exit 1; }
  fi
else
  MODEL=${ROOFLINE_DEVICE_MODEL:-}  # a dry run elsewhere: the embedded model
  export PYTHONPATH=$PWD
fi
DEVICE=${ROOFLINE_DEVICE:-cuda}
PY=${PYTHON:-python3}
MODEL_ARG=(); [ -n "$MODEL" ] && MODEL_ARG=(--model "$MODEL")
log "machine"; { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true; \
  $PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"; } | tee -a "$OUT/report.txt"
if [ "${1:-}" = tests ]; then  # the first call: the CUDA tests (kernels compiled for the GPU, graphs vs eager)
  log "tests on $DEVICE"
  timeout 240 $PY -m pytest -q -p no:cacheprovider -o addopts= tests/test_torch_cuda.py tests/test_torch_graphs.py \
    2>&1 | tee -a "$OUT/report.txt"
  log "done"; exit 0
fi
bench() {  # bench NAME TIMEOUT ARGS...: roofline bench of the torch backend on $DEVICE
  local name=$1 limit=$2; shift 2
  timeout "$limit" $PY -m app.cli bench "${MODEL_ARG[@]}" --backend torch --device "$DEVICE" -p ${PP:-512} -n ${TG:-128} \
    --batch ${BATCHES:-1,8,32,64} --repeats ${REPEATS:-3} --json "$OUT/$name.json" --markdown "$@" 2>&1 | tee -a "$OUT/report.txt"
}
if [ "${1:-}" = server ]; then  # issue 7 on a bandwidth-bound backend: roofline serve --backend torch on CUDA
  log "server under load: roofline serve --backend torch --device $DEVICE, 1/4/8/16 streaming clients"
  timeout 300 $PY bench/server.py "${MODEL_ARG[@]}" --torch --torch-device "$DEVICE" --only roofline-torch \
    --clients 1,4,8,16 --requests-per-client 2 --max-tokens ${TG:-64} --cost-curve 1,2,4,8,16 2>&1 | tee -a "$OUT/report.txt"
  log "done"; exit 0
fi
if [ "${1:-}" = speculative ]; then  # issue 6 on a bandwidth-bound backend
  log "speculative decoding: torch backend on $DEVICE, plain vs prompt lookup vs auto"
  timeout 240 $PY bench/speculative.py "${MODEL_ARG[@]}" --backend torch --device "$DEVICE" --modes plain prompt-lookup auto \
    --repeats ${SPEC_REPEATS:-3} 2>&1 | tee -a "$OUT/report.txt"
  log "done"; exit 0
fi
log "parity: torch on $DEVICE vs MLX on the CPU"
timeout 150 $PY -m app.cli parity "${MODEL_ARG[@]}" --backends mlx,torch --device "$DEVICE" --steps 64 \
  --json "$OUT/parity.json" 2>&1 | tee -a "$OUT/report.txt"
if [ "${1:-}" = fusion ]; then  # the A/B of the fused norm, rope and gate kernels (graphs on for both)
  log "roofline bench: torch backend on $DEVICE, fused kernels (the default)"
  bench bench_fused 100 --context 0
  log "roofline bench: torch backend on $DEVICE, unfused (ROOFLINE_TORCH_UNFUSED=1)"
  export ROOFLINE_TORCH_UNFUSED=1; bench bench_unfused 100 --context 0; unset ROOFLINE_TORCH_UNFUSED
  log "done"; exit 0
fi
log "parity: torch on $DEVICE in float32 vs MLX on the CPU (no float16 ties)"
timeout 150 $PY -m app.cli parity "${MODEL_ARG[@]}" --backends mlx,torch --device "$DEVICE" --dtype float32 --steps 64 \
  --json "$OUT/parity_fp32.json" 2>&1 | tee -a "$OUT/report.txt"
log "roofline bench: torch backend on $DEVICE, CUDA graphs (the default)"
bench bench_torch 120 --context 0
log "roofline bench: torch backend on $DEVICE, CUDA graphs off (eager launches)"
bench bench_torch_eager 120 --context 0 --no-cuda-graphs
log "peer: HF transformers generate() on $DEVICE"
timeout 120 $PY bench/hf_generate_peer.py "${MODEL_ARG[@]}" --device "$DEVICE" -n ${TG:-128} --batch ${BATCHES:-1,8,32,64} \
  --json "$OUT/hf_generate.json" 2>&1 | tee -a "$OUT/report.txt"
log "roofline bench: torch backend on $DEVICE, decode after 4096 tokens of context"
bench bench_torch_depth 120 --context 4096
log "done"
