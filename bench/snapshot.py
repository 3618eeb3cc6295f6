"""Snapshot and restore throughput beside a plain parallel memcpy of the same bytes.

For each total size and tensor shape (a few large tensors, or many 64 KiB
ones), with checksums on and off, it times ``snapshot(v).wait()`` and
``restore(v)`` through the public API and, in the same run, the fastest plain
parallel copy of the same source tensors into one pre-faulted region: glibc
``memcpy`` or a non-temporal streaming copy, any thread count up to the cores
available. That is the limit a snapshot copy can approach.
Prints a table and writes ``bench/results/snapshot.json``.

    python bench/snapshot.py            # 64 MiB .. 2 GiB
    python bench/snapshot.py --quick    # under a minute
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import peerstate
from peerstate import _C

MiB = 1 << 20
SMALL_TENSOR = 64 * 1024
LARGE_TENSORS = 4


def make_tensors(total: int, shape: str) -> list:
    per = total // LARGE_TENSORS if shape == "large" else SMALL_TENSOR
    # Filled, so every page is really backed (an untouched page reads as the shared zero page).
    return [torch.ones(per // 4, dtype=torch.float32) for _ in range(total // per)]


def best_copy_GBps(tensors: list, repeats: int) -> tuple:
    """The fastest plain parallel copy of these bytes: glibc memcpy or a streaming
    (non-temporal) copy, any thread count. Returns (GB/s, which)."""
    sources = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]
    total = sum(n for _, n in sources)
    timings = {}
    for streaming in (False, True):
        for threads in range(1, _C.available_cores() + 1):
            kind = f"{'streaming' if streaming else 'memcpy'} x{threads}"
            timings[kind] = _C.measure_parallel_memcpy(sources, threads, repeats, streaming)
    kind = min(timings, key=timings.get)
    return total / timings[kind] / 1e9, kind


def time_store(tensors: list, checksums: bool, repeats: int) -> tuple:
    total = sum(t.numel() * t.element_size() for t in tensors)
    store = peerstate.SnapshotStore(checksums=checksums)
    try:
        store.register_many({f"t{i}": t for i, t in enumerate(tensors)})
        version = 0
        for _ in range(2):  # warm both version slots (their memory is allocated on first use)
            version += 1
            store.snapshot(version).wait()
        snap, restore = [], []
        for _ in range(repeats):
            version += 1
            start = time.perf_counter()
            store.snapshot(version).wait()
            snap.append(time.perf_counter() - start)
        for _ in range(repeats):
            start = time.perf_counter()
            store.restore(version)
            restore.append(time.perf_counter() - start)
        return total / min(snap) / 1e9, total / statistics.median(snap) / 1e9, total / min(restore) / 1e9
    finally:
        store.close()


def pinned_copy_GBps(tensors: list, repeats: int) -> tuple:
    """The limit on a GPU: torch's device-to-host and host-to-device copies of the same
    tensors into / out of pinned host memory, one stream, synchronised."""
    pinned = [torch.empty_like(t, device="cpu").pin_memory() for t in tensors]
    total = sum(t.numel() * t.element_size() for t in tensors)
    d2h, h2d = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for p, t in zip(pinned, tensors):
            p.copy_(t, non_blocking=True)
        torch.cuda.synchronize()
        d2h.append(time.perf_counter() - start)
        start = time.perf_counter()
        for p, t in zip(pinned, tensors):
            t.copy_(p, non_blocking=True)
        torch.cuda.synchronize()
        h2d.append(time.perf_counter() - start)
    return total / min(d2h) / 1e9, total / min(h2d) / 1e9


def run_device(sizes_mib: list, repeats: int) -> list:
    rows = []
    for size in sizes_mib:
        for shape in ("large", "64KiB"):
            tensors = [t.cuda() for t in make_tensors(size * MiB, shape)]
            d2h, h2d = pinned_copy_GBps(tensors, repeats)
            snap_best, snap_median, restore_best = time_store(tensors, True, repeats)
            tag = f"{size}MiB {shape} crc cuda"
            rows.append(dict(case=f"snapshot {tag}", ours_GBps=snap_best, median_GBps=snap_median,
                             limit_GBps=d2h, limit_kind="pinned D2H copy_", ratio=snap_best / d2h))
            rows.append(dict(case=f"restore {tag}", ours_GBps=restore_best, median_GBps=None,
                             limit_GBps=h2d, limit_kind="pinned H2D copy_", ratio=restore_best / h2d))
            del tensors
    return rows


def run(sizes_mib: list, repeats: int) -> list:
    rows = []
    for size in sizes_mib:
        for shape in ("large", "64KiB"):
            tensors = make_tensors(size * MiB, shape)
            limit, limit_kind = best_copy_GBps(tensors, repeats)
            for checksums in (True, False):
                snap_best, snap_median, restore_best = time_store(tensors, checksums, repeats)
                tag = f"{size}MiB {shape} {'crc' if checksums else 'nocrc'}"
                rows.append(dict(case=f"snapshot {tag}", ours_GBps=snap_best, median_GBps=snap_median,
                                 limit_GBps=limit, limit_kind=limit_kind, ratio=snap_best / limit))
                rows.append(dict(case=f"restore {tag}", ours_GBps=restore_best, median_GBps=None,
                                 limit_GBps=limit, limit_kind=limit_kind, ratio=restore_best / limit))
            del tensors
    return rows


def print_table(rows: list) -> None:
    print(f"{'case':<36}{'ours GB/s':>11}{'median':>9}{'limit GB/s':>12}{'ratio':>8}  limit")
    for r in rows:
        median = f"{r['median_GBps']:.2f}" if r["median_GBps"] is not None else "-"
        print(f"{r['case']:<36}{r['ours_GBps']:>11.2f}{median:>9}{r['limit_GBps']:>12.2f}{r['ratio']:>8.2f}  {r['limit_kind']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 and 256 MiB only (under a minute)")
    parser.add_argument("--sizes", type=int, nargs="*", help="total state sizes in MiB")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: snapshot CUDA tensors, compared with torch's pinned copies")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    sizes = args.sizes or ([64, 256] if args.quick else [64, 256, 1024, 2048])
    repeats = args.repeats or (3 if args.quick else 5)
    name = "snapshot" if args.device == "cpu" else "snapshot_cuda"
    out = args.out or str(Path(__file__).parent / "results" / f"{name}.json")
    rows = run(sizes, repeats) if args.device == "cpu" else run_device(sizes, repeats)
    print_table(rows)
    result = dict(
        benchmark=name,
        command="python " + " ".join([f"bench/{Path(__file__).name}", *(argv if argv is not None else sys.argv[1:])]),
        machine=dict(cores=_C.available_cores(), cpu=platform.processor() or platform.machine(),
                     crc32c_hardware=_C.crc32c_hardware_available(), cuda_available=peerstate.cuda_available()),
        repeats=repeats, rows=rows,
    )
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
