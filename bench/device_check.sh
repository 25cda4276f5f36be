#!/usr/bin/env bash
# The device check of issue 8, for one lent NVIDIA H200 (see bench/device_prep.sh for how its files get
# there). Under 5 minutes: parity of SmolLM2 between the torch backend on CUDA and the MLX engine on the
# CPU (64 greedy steps, KL per position), the torch backend's decode at batch 1, 8, 32 and 64 as a share
# of the H200's 4.8 TB/s, and HF transformers' generate() on the same GPU as the peer.
# Everything it writes goes to $OUT (the device tool brings it back) or /tmp/device_out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device_out}; mkdir -p "$OUT"
log() { echo "== $* ($(date -u +%H:%M:%S))" | tee -a "$OUT/log.txt"; }
MODEL=/tmp/smollm2.gguf
if [ -d .dev/whl ]; then
  cat .dev/p1/smollm2.gguf.part .dev/p2/smollm2.gguf.part .dev/p3/smollm2.gguf.part > "$MODEL" || exit 1
  [ "$(sha256sum "$MODEL" | cut -d' ' -f1)" = "$(cat .dev/whl/smollm2.sha256)" ] || { echo "model parts corrupt"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  MODEL=${ROOFLINE_DEVICE_MODEL:-}  # a dry run elsewhere: the embedded model
  export PYTHONPATH=$PWD
fi
DEVICE=${ROOFLINE_DEVICE:-cuda}
PY=${PYTHON:-python3}
MODEL_ARG=(); [ -n "$MODEL" ] && MODEL_ARG=(--model "$MODEL")
log "machine"; { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true; \
  $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"; } | tee "$OUT/machine.txt"
log "parity: torch on $DEVICE vs MLX on the CPU"
timeout 150 $PY -m app.cli parity "${MODEL_ARG[@]}" --backends mlx,torch --device "$DEVICE" --steps 64 \
  --json "$OUT/parity.json" 2>&1 | tee "$OUT/parity.txt"
log "roofline bench: torch backend on $DEVICE"
timeout 150 $PY -m app.cli bench "${MODEL_ARG[@]}" --backend torch --device "$DEVICE" -p 512 -n ${TG:-128} \
  --batch ${BATCHES:-1,8,32,64} --repeats ${REPEATS:-3} --json "$OUT/bench_torch.json" --markdown 2>&1 | tee "$OUT/bench_torch.txt"
log "peer: HF transformers generate() on $DEVICE"
timeout 120 $PY bench/hf_generate_peer.py "${MODEL_ARG[@]}" --device "$DEVICE" -n ${TG:-128} --batch ${BATCHES:-1,8,32,64} \
  --json "$OUT/hf_generate.json" 2>&1 | tee "$OUT/hf_generate.txt"
log "done"
