#!/usr/bin/env bash
# One prepared run on a lent GPU machine: build, the GPU tests, the device
# stand-in tests, the snapshot benchmark on the device, and a recovery with
# CUDA state (4 workers and a spare on the one GPU, a worker and then a node
# killed, the final weights compared bit for bit with a fault-free run).
#
#   bash bench/gpu/check.sh                               # on the GPU machine (device tool)
#   PEERSTATE_CHECK_DEVICE=cpu bash bench/gpu/check.sh    # the rehearsal: the same steps on the CPU
#   PEERSTATE_CHECK_DEVICE=cpu PEERSTATE_CHECK_QUICK=1 ...   # CI's (tests/native/test_gpu_check.py): the
#       pytest steps only collect their tests (the suite runs them), the benchmark at one small size
#
# Uses the python3 on the PATH and the torch it has (a lent machine reaches no
# registry: it must bring torch with CUDA; peerstate is built here with
# --no-build-isolation, so scikit-build-core and pybind11 must be there too).
# Every step's log lands in $OUT (default bench/results/gpu); $OUT/summary.txt
# has one line per step; the exit status is 1 if any step failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-bench/results/gpu}"
DEVICE="${PEERSTATE_CHECK_DEVICE:-cuda}"
if [ "${PEERSTATE_CHECK_QUICK:-0}" = 1 ]; then
  COLLECT="--collect-only"; SIZES="16"
else
  COLLECT=""; SIZES="256 1024"
fi
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
: > "$OUT/summary.txt"
failed=0

step() {  # step NAME COMMAND...: runs it with its output in $OUT/NAME.log
  local name=$1 started rc
  shift
  started=$(date +%s)
  echo "=== $name: $*"
  "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc seconds=$(( $(date +%s) - started ))" | tee -a "$OUT/summary.txt"
  tail -n 4 "$OUT/$name.log"
  [ "$rc" -eq 0 ] || failed=1
}

if [ "$DEVICE" = cuda ]; then
  step nvidia-smi nvidia-smi
  step build env PEERSTATE_CUDA=ON "$PYTHON" -m pip install --no-deps --no-build-isolation -e .
  GPU_TESTS="tests/native/test_snapshot_cuda.py tests/replication/test_replica_device.py tests/native/test_nccl_loader.py"
else
  GPU_TESTS="tests/native/test_nccl_loader.py"
fi
step build-info "$PYTHON" -c "import peerstate, torch; print('cuda_compiled', peerstate.cuda_compiled(),
  'cuda_available', peerstate.cuda_available(), 'devices', peerstate._C.cuda_device_count(),
  'torch', torch.__version__, 'torch.cuda', torch.cuda.is_available())"
# shellcheck disable=SC2086
step gpu-tests "$PYTHON" -m pytest -rs -q $COLLECT $GPU_TESTS tests/native/test_snapshot_store.py
# shellcheck disable=SC2086
step standin-tests "$PYTHON" -m pytest -rs -q $COLLECT tests/native/test_device_standins.py
# shellcheck disable=SC2086
step snapshot-bench "$PYTHON" bench/snapshot.py --device "$DEVICE" --sizes $SIZES \
  --out "$OUT/snapshot_$DEVICE.json"
# NCCL refuses two ranks on one GPU ("Duplicate GPU"); the nccl transfer test needs 2 GPUs
# and says so in gpu-tests. The recovery below keeps CUDA state under gloo process groups.
step recovery "$PYTHON" -m peerstate demo --steps 14 --kill-worker-at 4 --kill-node-at 9 --width 64 --layers 1 \
  --device "$DEVICE" --out "$OUT/demo_$DEVICE"
grep -h "bitwise check" "$OUT/recovery.log" | tee -a "$OUT/summary.txt"
exit "$failed"
