#!/usr/bin/env bash
# Runs the native-heavy tests against an AddressSanitizer build of peerstate._C
# (host-only, in build/asan). Not part of CI (it takes a few minutes); run it
# after touching csrc/, especially the wire format or the tcp server.
#   bash tests/sanitize.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
build=build/asan
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPEERSTATE_CUDA=OFF \
  -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" \
  -DCMAKE_CXX_FLAGS="-fsanitize=address -fno-omit-frame-pointer" \
  -DCMAKE_MODULE_LINKER_FLAGS="-fsanitize=address" >/dev/null
cmake --build "$build" >/dev/null
rm -rf "$build/pkg" && mkdir -p "$build/pkg"
cp -r python/peerstate "$build/pkg/" && cp "$build"/_C*.so "$build/pkg/peerstate/"
# libstdc++ must be preloaded with the runtime, or ASan cannot intercept C++ throws.
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1"
export PYTHONPATH="$PWD/$build/pkg"
if [ $# -eq 0 ]; then
  set -- tests/replication/test_tcp_transport.py tests/replication/test_hostile_peers.py tests/replication/test_hostile_connections.py tests/native/test_crc32c.py tests/native/test_snapshot_store.py tests/replication/test_replication.py
fi
python3 -m pytest -q -p no:cacheprovider "$@"
