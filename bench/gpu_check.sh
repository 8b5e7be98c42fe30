#!/usr/bin/env bash
# Every GPU check of flexengine in one call, <= 8 minutes (the device call's timeout_s: 480) on the lent H200 image as it is (its python3: torch 2.11,
# transformers 5.17; no Hydra, OmegaConf, antlr4 or torchao there, and no network). The missing packages travel
# as wheels in .whl/ (scripts/prepare_gpu_wheels.sh) and are installed here with --no-index into a temp dir.
# Checks run in order of what they decide (bench/gpu_check_list.py: the decisive ones first, among them the
# README's plan at the A100's budget), one worker process for all of them so compiles are shared, one compile cache
# for the whole call; each appends its JSON line to $OUT/gpu_check.jsonl as it ends, so a cut-off run still
# returns everything done, and a check killed at its cap is `timed_out` with how far it got.
# bench/README.md has the one command line for the device machine.
#   bash bench/gpu_check.sh                     # all checks -> ${OUT:-bench/results}/gpu_check.{jsonl,json,md,log}
#   bash bench/gpu_check.sh --only train doctor # checks whose name contains one of these words
#   bash bench/gpu_check.sh --dry-run           # CPU: imports, every config, each check's CPU part
#                                               #   -> bench/results/gpu_check_dryrun.{jsonl,json,md,log}
#   bash bench/gpu_check.sh --dry-run --fast    # the same without CPU training steps (the CI test's subset)
# Exit status 0 when every decisive check passed and none failed (a check this torch cannot run says
# "skipped: torch X lacks Y"; later checks the budget does not reach are listed as not_run).
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
BUDGET_S=${GPU_CHECK_BUDGET_S:-470}  # the whole call: wheels, probes, checks (gpu_check_list.CALL_BUDGET_S)
END_S=20  # the driver's last kill (SIGTERM, SIGKILL 10 s later) and its summary, inside the budget
case " $* " in *" --dry-run "*) BUDGET_S=${GPU_CHECK_BUDGET_S:-2400} ;; esac  # 2 shared CPU cores, no GPU
PY=${PYTHON:-python3}  # the image's own interpreter (its torch, transformers, safetensors); PYTHON= overrides
OUT_DIR=${OUT:-bench/results}
mkdir -p "$OUT_DIR"
# Carried wheels -> a temp site dir, the way the device notes say (no index, no deps, no compile); skipped when
# this python already imports them (a venv that has them, or a second call that put them on PYTHONPATH). Neither:
# stop here, in seconds, rather than let every check fail on an import (.whl/ is git-ignored: a fresh checkout
# has none).
SITE=${GPU_CHECK_SITE:-/tmp/flexengine-site}
CARRIED="import hydra, omegaconf, antlr4, torchao"
if ! "$PY" -c "$CARRIED" 2>/dev/null && ! PYTHONPATH="$SITE" "$PY" -c "$CARRIED" 2>/dev/null \
  && ! compgen -G ".whl/*.whl" >/dev/null; then
  echo "$PY lacks hydra/omegaconf/antlr4/torchao and there is no .whl/ to install them from: run" \
    "'bash scripts/prepare_gpu_wheels.sh' here, then carry .whl with the device call (bench/README.md)" >&2
  exit 2
fi
if ! "$PY" -c "$CARRIED" 2>/dev/null; then  # from .whl/, or a previous call's site dir on a still-warm machine
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
      || { echo "installing .whl/*.whl into $SITE failed"; exit 3; }
  fi
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
LEFT=$((BUDGET_S - (SECONDS - START)))
# The driver kills the last check by LEFT - END_S + 15 and writes its summary; timeout at LEFT (-k 5: at most
# BUDGET_S + 5 s in all, 475 s by default, within the device call's 480) is the last resort if it hangs.
timeout -k 5 "$LEFT" "$PY" bench/gpu_check.py --out-dir "$OUT_DIR" --budget-s $((LEFT - END_S)) "$@"
rc=$?
[ $rc -eq 124 ] || [ $rc -eq 137 ] && echo "bench/gpu_check.py itself was killed at the time limit; $OUT_DIR/gpu_check*.jsonl holds the checks done"
exit $rc
