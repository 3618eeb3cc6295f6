#!/usr/bin/env bash
# One prepared run on a lent GPU machine: build, GPU tests, GPU benchmarks.
# Usage (device tool): bash bench/gpu/check.sh   -- results land in $OUT (or bench/results).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
{
  nvidia-smi || true
  python3 -m venv .venv-gpu && . .venv-gpu/bin/activate
  # The GPU machine brings its own CUDA torch; fall back to PyPI's otherwise.
  pip install --quiet torch ".[test]" 2>&1 | tail -3
  python -c "import peerstate, torch; print('cuda_compiled', peerstate.cuda_compiled(), 'cuda_available', peerstate.cuda_available(), 'torch', torch.__version__, torch.cuda.is_available())"
  python -m pytest -rs -q tests/native/test_snapshot_cuda.py tests/replication/test_replica_device.py tests/native/test_nccl_loader.py \
    tests/native/test_snapshot_store.py tests/replication/test_tcp_transport.py
  python bench/snapshot.py --device cuda --sizes 256 1024 --out "$OUT/snapshot_cuda.json"
  python bench/snapshot.py --quick --out "$OUT/snapshot_gpu_host.json"
} 2>&1 | tee "$OUT/check.log"
