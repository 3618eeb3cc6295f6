"""Snapshot and restore throughput beside a plain parallel copy of the same bytes.

For each total size and tensor shape (a few large tensors, or many 64 KiB
ones), with checksums on and off, it times ``snapshot(v).wait()`` and
``restore(v)`` (after one value per 64 KiB was changed, so that every chunk is
written back) through the public API and, in the same run, the fastest plain
parallel copy of the same source tensors into one pre-faulted region: glibc
``memcpy`` or a non-temporal streaming copy, any thread count up to the cores
available. That is the limit a snapshot copy can approach. Each keeps its
best of the same number of rounds: at least ``--repeats``, and at small sizes
as many as copy 2 GiB (a 64 MiB copy takes ~3 ms, and best-of-7 of that moved
by +-15% between runs on a shared VM). Prints a table and writes
``bench/results/snapshot.json``.

    python bench/snapshot.py                 # 64 MiB .. 2 GiB
    python bench/snapshot.py --quick         # under a minute
    python bench/snapshot.py --device cuda   # CUDA tensors beside torch's pinned copies
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

import peerstate
from peerstate import _C, _probes

MiB = 1 << 20
SMALL_TENSOR = 64 * 1024
LARGE_TENSORS = 4


def make_tensors(total: int, shape: str) -> list:
    per = total // LARGE_TENSORS if shape == "large" else SMALL_TENSOR
    # Filled, so every page is really backed (an untouched page reads as the shared zero page).
    return [torch.ones(per // 4, dtype=torch.float32) for _ in range(total // per)]


def nbytes(tensors: list) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def copy_kinds() -> list:
    """(streaming, threads) of every plain parallel copy tried as the limit."""
    return [(streaming, threads) for streaming in (False, True) for threads in range(1, _probes.available_cores() + 1)]


def kind_name(kind: tuple) -> str:
    return f"{'streaming' if kind[0] else 'memcpy'} x{kind[1]}"


def touch_every_chunk(tensors: list) -> None:
    """Change one value per 64 KiB of every tensor (a few cache lines in all), so that
    every chunk differs from the snapshot early on and a restore has to write it all."""
    for t in tensors:
        t.view(-1)[:: SMALL_TENSOR // t.element_size()] += 1


def measure(tensors: list, checksums: bool, repeats: int, limits: bool = True) -> dict:
    """Best seconds of snapshot(v).wait() and of restore(v) over `repeats` rounds and,
    with `limits`, of each plain copy of the same bytes over as many. Each side runs
    its rounds back to back: interleaving them measured the write-back of the other
    side's dirty cache lines (this machine has a 480 MiB L3) more than either copy."""
    sources = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]
    best = {kind: _probes.measure_parallel_memcpy(sources, kind[1], repeats, kind[0]) for kind in copy_kinds()} if limits else {}
    store = peerstate.SnapshotStore(checksums=checksums)
    best.update(snapshot=float("inf"), restore=float("inf"))
    try:
        store.register_many({f"t{i}": t for i, t in enumerate(tensors)})
        store.allocate()
        version = 0
        for _ in range(2):  # warm both version slots
            version += 1
            store.snapshot(version).wait()
        for _ in range(repeats):
            version += 1
            start = time.perf_counter()
            store.snapshot(version).wait()
            best["snapshot"] = min(best["snapshot"], time.perf_counter() - start)
        for _ in range(repeats):
            touch_every_chunk(tensors)  # a restore leaves chunks equal to the live bytes alone
            start = time.perf_counter()
            store.restore(version)
            best["restore"] = min(best["restore"], time.perf_counter() - start)
    finally:
        store.close()
    return best


def rounds(size_mib: int, repeats: int) -> int:
    """Rounds per side at this size: at least `repeats`, and enough to copy 2 GiB."""
    return max(repeats, -(-2048 // size_mib))


def run(sizes_mib: list, repeats: int) -> list:
    rows = []
    for size in sizes_mib:
        for shape in ("large", "64KiB"):
            tensors = make_tensors(size * MiB, shape)
            total = nbytes(tensors)
            for checksums in (True, False):
                best = measure(tensors, checksums, rounds(size, repeats))
                kind = min(copy_kinds(), key=best.get)
                limit = total / best[kind] / 1e9
                tag = f"{size}MiB {shape} {'crc' if checksums else 'nocrc'}"
                for op in ("snapshot", "restore"):
                    ours = total / best[op] / 1e9
                    rows.append(dict(case=f"{op} {tag}", ours_GBps=ours, limit_GBps=limit,
                                     limit_kind=kind_name(kind), ratio=ours / limit, rounds=rounds(size, repeats)))
            del tensors
    return rows


def pinned_copy_GBps(tensors: list, repeats: int) -> tuple:
    """The limit on a GPU: torch's device-to-host and host-to-device copies of the same
    tensors into / out of pinned host memory, one stream, synchronised."""
    pinned = [torch.empty_like(t, device="cpu").pin_memory() for t in tensors]
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
    return nbytes(tensors) / min(d2h) / 1e9, nbytes(tensors) / min(h2d) / 1e9


def run_device(sizes_mib: list, repeats: int) -> list:
    rows = []
    for size in sizes_mib:
        for shape in ("large", "64KiB"):
            tensors = [t.cuda() for t in make_tensors(size * MiB, shape)]
            d2h, h2d = pinned_copy_GBps(tensors, repeats)
            best = measure(tensors, True, repeats, limits=False)
            snap, restore = nbytes(tensors) / best["snapshot"] / 1e9, nbytes(tensors) / best["restore"] / 1e9
            tag = f"{size}MiB {shape} crc cuda"
            rows.append(dict(case=f"snapshot {tag}", ours_GBps=snap, limit_GBps=d2h,
                             limit_kind="pinned D2H copy_", ratio=snap / d2h))
            rows.append(dict(case=f"restore {tag}", ours_GBps=restore, limit_GBps=h2d,
                             limit_kind="pinned H2D copy_", ratio=restore / h2d))
            del tensors
    return rows


def print_table(rows: list) -> None:
    print(f"{'case':<36}{'ours GB/s':>11}{'limit GB/s':>12}{'ratio':>8}  limit")
    for r in rows:
        print(f"{r['case']:<36}{r['ours_GBps']:>11.2f}{r['limit_GBps']:>12.2f}{r['ratio']:>8.2f}  {r['limit_kind']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 and 256 MiB only (under a minute)")
    parser.add_argument("--sizes", type=int, nargs="*", help="total state sizes in MiB")
    parser.add_argument("--repeats", type=int, default=None,
                        help="least rounds per measurement (default 3 quick, 7 full; more at small sizes)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: snapshot CUDA tensors, compared with torch's pinned copies")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    sizes = args.sizes or ([64, 256] if args.quick else [64, 256, 1024, 2048])
    repeats = args.repeats or (3 if args.quick else 7)
    name = "snapshot" if args.device == "cpu" else "snapshot_cuda"
    out = args.out or str(Path(__file__).parent / "results" / f"{name}.json")
    rows = run(sizes, repeats) if args.device == "cpu" else run_device(sizes, repeats)
    print_table(rows)
    result = dict(
        benchmark=name,
        command="python " + " ".join([f"bench/{Path(__file__).name}", *(argv if argv is not None else sys.argv[1:])]),
        machine=dict(cores=_probes.available_cores(), cpu=platform.processor() or platform.machine(),
                     crc32c_hardware=_probes.crc32c_hardware_available(), cuda_available=peerstate.cuda_available()),
        repeats=repeats, rows=rows,
    )
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
