#!/usr/bin/env bash
# The prepared run for a GPU machine (docs/gpu.md, "Running the check on a GPU machine"): from the repository root,
#   bash bench/gpu_device_run.sh
# after `make gpu-wheels` here (the wheels the machine lacks, carried as .whl/). It installs those wheels, builds the
# native extension (optional: kvproc falls back to numpy without it), prints the machine, runs `kvproc bench gpu`
# and then the CUDA tests, each under a timeout, teeing everything into $OUT. It never stops at a failing step: every
# step runs and the summary at the end (the tail a device tool shows) says what passed; the exit status is 0 only if
# every step did. Python: $PY (default python3). Locally, as a dry run of its CPU parts:
#   PY=.venv/bin/python WHL=/tmp/whl311 SITE=/tmp/site311 OUT=/tmp/gpuout bash bench/gpu_device_run.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-/tmp/gpuout}
WHL=${WHL:-.whl}
SITE=${SITE:-/tmp/site}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-300}  # the outer guard; the bench's own budget (--budget) is 240 s
TEST_TIMEOUT=${TEST_TIMEOUT:-180}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
T0=$(date +%s)
SUMMARY=()

step() { echo; echo "=== $1 (+$(( $(date +%s) - T0 )) s)"; }
record() {  # record NAME RC
  SUMMARY+=("$(printf '%-10s %s' "$1" "$([ "$2" -eq 0 ] && echo ok || echo "FAILED (status $2)")")")
}

step "wheels from $WHL into $SITE"
rc=0
if ls "$WHL"/*.whl >/dev/null 2>&1; then
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHL"/*.whl; then
    echo "pip install failed (or no pip): unpacking the wheels instead"
    mkdir -p "$SITE"
    for w in "$WHL"/*.whl; do "$PY" -m zipfile -e "$w" "$SITE" || rc=1; done
  fi
else
  echo "no wheels in $WHL (run 'make gpu-wheels' before the device run): using what $PY has"
  rc=1
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import zmq, msgspec, structlog, posix_ipc, xxhash, setproctitle, psutil, prometheus_client; print('imports ok')" \
  || rc=1
record wheels $rc

step "native extension"
"$PY" setup.py -q build_ext --inplace > "$OUT/build_ext.log" 2>&1
rc=$?
tail -n 5 "$OUT/build_ext.log"
[ $rc -ne 0 ] && echo "build_ext failed: kvproc runs its numpy fallback (kvproc/native/__init__.py)"
"$PY" -c "import kvproc.native as n; print('kvproc.native:', n.describe())"
record build_ext $rc

step "machine"
{
  nvidia-smi || echo "nvidia-smi: not available"
  nvidia-smi -q 2>/dev/null | grep -A 14 "GPU Link Info" | head -16  # PCIe generation and width, max and current
  echo; uname -a; nproc; free -g; df -h /dev/shm /tmp
  "$PY" - <<'EOF'
import sys
import numpy, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| numpy", numpy.__version__, "| cuda available:", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0), "count",
          torch.cuda.device_count())
try:
    import cupy
    print("cupy", cupy.__version__)
except Exception as e:
    print("cupy: not importable:", e)
EOF
} 2>&1 | tee "$OUT/machine.txt"

step "kvproc bench gpu (at most ${BENCH_TIMEOUT} s)"
timeout -k 10 "$BENCH_TIMEOUT" "$PY" -m kvproc bench gpu --budget 240 --json "$OUT/gpu.json" 2>&1 | tee "$OUT/gpu.log"
rc=${PIPESTATUS[0]}
record bench $rc

step "CUDA tests (at most ${TEST_TIMEOUT} s)"
# the test files with CUDA-only tests (skipif not CUDA): the CPU-only ones in them skip on a GPU
TESTS=$(grep -l "skipif(not CUDA" -r tests --include='test_*.py' | sort)
echo "$TESTS"
# shellcheck disable=SC2086
timeout -k 10 "$TEST_TIMEOUT" "$PY" -m pytest -v -rs --timeout 120 \
  --junitxml "$OUT/pytest.xml" $TESTS 2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
record pytest $rc

step "summary"
{
  printf '%s\n' "${SUMMARY[@]}"
  grep -E "GB/s" "$OUT/gpu.log" | grep -E " cuda" | head -30  # the movers against pinned copy_, side by side
  grep -E "^\[FAILED\]|parts passed|SKIPPED" "$OUT/gpu.log" | head -40
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -15
  echo "total $(( $(date +%s) - T0 )) s; results in $OUT"
} | tee "$OUT/summary.txt"
for line in "${SUMMARY[@]}"; do
  case "$line" in *FAILED*) exit 1 ;; esac
done
exit 0
