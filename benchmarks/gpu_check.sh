#!/usr/bin/env bash
# qkv's GPU check: every CUDA path once, on one GPU, in about 4 minutes, then one summary table.
#
# It needs the dev set-up (`bash scripts/setup.sh --dev`: pytest for the tests, transformers for decode).
#
#   bash benchmarks/gpu_check.sh               # on a machine with a CUDA GPU (qkv from ./src, not installed)
#   bash benchmarks/gpu_check.sh --dry-run     # every stage with tiny sizes on the CPU (tests/test_cuda.py runs it)
#   bash benchmarks/gpu_check.sh decode fsdp   # only these stages
#
# Stages (benchmarks/gpu_check.py STAGE), each under its own timeout: env (torch, CUDA, the device, its bf16
# matmul peak), tests (pytest -m cuda tests/test_cuda.py), throughput (GPT-2 124M's shape, bf16, torch.compile,
# MFU), attention (flash attention at T = 8,192 and 32,768: time, memory, their ratio), decode (tok/s against
# transformers) and fsdp (3 FSDP2 steps on a process group of one, built on the meta device: float32 equal
# to one process; bf16 eager and compiled). The output also goes to $OUT/gpu_check.log
# (a temporary directory's without $OUT). PYTHON picks the interpreter (default: .venv/bin/python, else python3).
# GPU_CHECK_BUDGET (seconds, default 300) caps the whole run: a stage gets at most what is left of it, one that
# would start with under 10 s left is skipped, and the table is always printed.
set -u -o pipefail
cd "$(dirname "$0")/.."

all_stages=(env tests throughput attention decode fsdp)
dry=""
stages=()
for arg in "$@"; do
  case $arg in
    --dry-run) dry="--dry-run" ;;
    env | tests | throughput | attention | decode | fsdp) stages+=("$arg") ;;
    *) echo "usage: bash benchmarks/gpu_check.sh [--dry-run] [${all_stages[*]}]" >&2; exit 2 ;;
  esac
done
[[ ${#stages[@]} -gt 0 ]] || stages=("${all_stages[@]}")
budget=${GPU_CHECK_BUDGET:-300}

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
work=$(mktemp -d)
log_dir=${OUT:-$(mktemp -d)}
mkdir -p "$log_dir"
log=$log_dir/gpu_check.log
: >"$log"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export QKV_CACHE_DIR="$work/qkv-cache"  # the corpus cache of this check alone (prepared once, by the first stage)
export MPLBACKEND=Agg

# The stages' seconds: generous against the typical ones (env 15, tests 90, throughput 80, attention 15,
# decode 30, fsdp 45 on an H100), so one slow stage cannot eat the whole call. A dry run is all-CPU and tiny.
declare -A limit=([env]=60 [tests]=180 [throughput]=180 [attention]=90 [decode]=120 [fsdp]=120)
rows=()

say() { echo "$*" | tee -a "$log"; }

stage() {  # NAME: run benchmarks/gpu_check.py NAME under its timeout; record PASS/FAIL/TIMEOUT, seconds, figure
  local name=$1 started=$SECONDS status code
  local left=$((budget - SECONDS - 5))  # 5 s for the kill and the table
  if ((left < 10)); then
    rows+=("| $name | SKIPPED | 0 | out of time: GPU_CHECK_BUDGET=$budget s spent |")
    return
  fi
  local seconds=$((left < limit[$name] ? left : limit[$name]))
  say ""
  say "=== $name (timeout $seconds s) ==="
  timeout --kill-after=5 "$seconds" "$PYTHON" benchmarks/gpu_check.py "$name" $dry 2>&1 \
    | tee "$work/$name.out" | tee -a "$log"
  code=${PIPESTATUS[0]}
  local figure
  figure=$(grep '^FIGURE: ' "$work/$name.out" | tail -n 1 | cut -c 9-)
  case $code in
    0) status=PASS ;;
    124 | 137) status=TIMEOUT ;;
    *) status="FAIL (exit $code)" ;;
  esac
  if [[ $code == 0 && -z $figure ]]; then status="FAIL (no figure)"; fi
  if [[ $code != 0 && -z $figure ]]; then figure=$(grep -v '^\s*$' "$work/$name.out" | tail -n 1 | cut -c 1-200); fi
  rows+=("| $name | $status | $((SECONDS - started)) | ${figure//|//} |")
}

say "qkv GPU check${dry:+ (dry run: tiny sizes on the CPU)}, $(date -u '+%Y-%m-%d %H:%M UTC'), $(git log -1 --format=%h 2>/dev/null || echo 'no git'), python $("$PYTHON" -c 'import sys; print(sys.version.split()[0])')"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$log"

for name in "${stages[@]}"; do
  stage "$name"
done

say ""
say "GPU CHECK SUMMARY${dry:+ (dry run)}"
say "| stage | result | s | figure |"
say "|---|---|---:|---|"
failed=0
for row in "${rows[@]}"; do
  say "$row"
  [[ $row == *"| PASS |"* ]] || failed=1
done
say "log: $log"
rm -rf "$work"
exit $failed
