#!/usr/bin/env bash
# Every GPU check of flexengine in one script, <= 8 minutes on one H200; one JSON at ${OUT:-bench/results}/gpu_check.json.
# Each check runs in its own process (bench/gpu_check.py: every `gpu` test function in tests/gpu/, then the scripted
# checks of bench/gpu_check_scripts.py) and the JSON is rewritten after every check and on the way out, so a crash,
# a CUDA error or the time limit still leaves the other checks' numbers. A skipped or uncollected GPU test fails.
# Exit status 0 only if every check passed.
#   bash bench/gpu_check.sh                    # all checks
#   bash bench/gpu_check.sh --only flex doctor # checks whose name contains one of these words
set -uo pipefail
cd "$(dirname "$0")/.."
# The first interpreter whose torch sees a GPU (the project venv, else the machine's python3); PYTHON= overrides.
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for cand in .venv/bin/python python3; do
    if command -v "$cand" >/dev/null && "$cand" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
      PY=$cand; break
    fi
  done
  PY=${PY:-.venv/bin/python}  # no GPU anywhere: gpu_check.py records every check as skipped
fi
OUT_DIR=${OUT:-bench/results}
mkdir -p "$OUT_DIR"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
export TOKENIZERS_PARALLELISM=false
# 400 s hard stop (the python side plans for 380 s and skips checks that would start too late)
timeout 400 "$PY" bench/gpu_check.py --out "$OUT_DIR/gpu_check.json" --budget-s 380 "$@"
rc=$?
[ $rc -eq 124 ] && echo "gpu_check.py hit the 400 s limit; partial results are in the JSON"
# 1-GPU FSDP2 smoke (#7): under torchrun even one process is sharded (fully_shard per block + root, bf16 params,
# fp32 reduce), trains, gathers the full state dict and writes an HF checkpoint; summary.json lands in $OUT_DIR.
timeout 70 "$PY" -m torch.distributed.run --nproc_per_node 1 -m flexengine.train debug=fast hardware=h100_80g \
  hydra.run.dir="$OUT_DIR/fsdp_smoke" > "$OUT_DIR/fsdp_smoke.log" 2>&1
fsdp_rc=$?
echo "fsdp smoke exit $fsdp_rc (log: $OUT_DIR/fsdp_smoke.log)"
[ $rc -eq 0 ] && rc=$fsdp_rc
# Profiler timeline (#16): activation-offload copies on their own stream, pinned, overlapping compute; batches
# copied from pinned memory. Writes $OUT_DIR/gpu_overlap.json.
timeout 150 "$PY" bench/gpu_overlap.py --out "$OUT_DIR/gpu_overlap.json" > "$OUT_DIR/gpu_overlap.log" 2>&1
overlap_rc=$?
echo "overlap check exit $overlap_rc (log: $OUT_DIR/gpu_overlap.log)"
[ $rc -eq 0 ] && rc=$overlap_rc
echo "exit $rc; results: $OUT_DIR/gpu_check.json"
exit $rc
