"""Redundancy modes side by side: what each holds and pushes per rank, and what
parity's coding costs beside a plain copy and plain TCP of the same bytes.

Modes: buddies (k = 1, 2: whole copies on other nodes, what the job runs today),
data-parallel shares (state already replicated: nothing pushed, nothing held
for others) and erasure-coded parity groups (g = 4, 8; one loss per group:
``peerstate.replication.parity``).

What is measured, per shard size, in this run:
- the limits: a parallel memcpy of the shard (``_probes``, the snapshot's own
  copy) and plain TCP over loopback of the shard (``bench/replication.py``'s
  baseline, one connection);
- parity's encode at one holder: the XOR of the g - 1 pieces it receives per
  version into its parity block (the work a holder does off the step, as a
  replica's receive is), on 1 thread and on every core;
- parity's rebuild: one holder's piece of a lost member (parity + g - 2
  survivors' pieces, what each of the g - 1 holders does at once in a
  recovery), and the whole shard rebuilt in one process (all g - 1 pieces one
  after another, every one checked bitwise against the lost shard).

What is computed from the layout, not measured: host memory per rank as a
multiple of its shard (own versions: 4 by default, 3 with the eager pipeline,
2 with the synced one, for every mode; held for others: two regions per copy
or parity block, as replicas are kept: the committed version and the incoming
one), bytes pushed per rank per version, and bytes a replacement pulls and
from how many sources.

Pieces are whole chunks of the snapshot (4 MiB, ``--chunk-bytes``), as the job
cuts them: a block is 1/(g - 1) of the shard rounded up to a chunk.

Not measured here: step overhead and kill-to-first-step with parity in the job
(``Job(parity_group=g)``); buddies' are in ``bench/recovery.py`` and
``bench/overhead.py``.

    python bench/redundancy.py            # shards of 64 MiB, 256 MiB and 1 GiB
    python bench/redundancy.py --quick    # 64 MiB and 256 MiB
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

from peerstate import _probes
from peerstate._C import ParityCoder
from peerstate.replication.parity import ParityLayout, encode, rebuild, rebuild_piece
from peerstate.state.snapshot import DEFAULT_CHUNK_BYTES
from peerstate.worker.options import JobOptions
from peerstate.worker.step_boundary import EAGER_VERSIONS, SYNCED_VERSIONS

sys.path.insert(0, str(Path(__file__).parent))
from replication import plain_tcp_GBps  # noqa: E402  (the same baseline as bench/replication.py)

MiB = 1 << 20
VERSIONS = JobOptions().versions  # own versions a rank keeps by default, whatever the mode
REGIONS = 2  # of each copy or parity block a holder keeps: the committed version and the incoming one


def best_of(repeats: int, fn) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def group_shards(size: int, members: int) -> list:
    """``members`` shards of ``size`` bytes of distinct content, each in memory of its
    own (shards that shared memory would be read from cache: faster than a real group)."""
    shards = []
    for member in range(members):
        words = np.arange(member * size // 8, (member + 1) * size // 8, dtype=np.uint64)
        words *= np.uint64(0x9E3779B97F4A7C15)  # a multiplicative hash: no byte pattern repeats
        shards.append(words.view(np.uint8))
    return shards


def limits(size: int, threads: int, repeats: int) -> dict:
    payload = group_shards(size, 1)[0]
    one = _probes.measure_parallel_memcpy([(payload.ctypes.data, size)], 1, repeats)
    every = _probes.measure_parallel_memcpy([(payload.ctypes.data, size)], threads, repeats)
    tcp_GBps, _ = plain_tcp_GBps(memoryview(payload), 1, repeats)
    return dict(memcpy_1_s=one, memcpy_all_s=every, tcp_s=size / tcp_GBps / 1e9)


def parity_row(size: int, members: int, threads: int, repeats: int, limit: dict, chunk_bytes: int) -> dict:
    layout = ParityLayout([size] * members, chunk_bytes)
    shards = group_shards(size, members)
    one, every = ParityCoder(1), ParityCoder(threads)
    parity = np.empty(layout.held_bytes(), np.uint8)
    encode_1 = best_of(repeats, lambda: encode(one, layout, 0, shards, out=parity))
    encode_all = best_of(repeats, lambda: encode(every, layout, 0, shards, out=parity))
    parities = [encode(every, layout, holder, shards) for holder in range(members)]
    lost = 0
    survivors = [None] + shards[1:]
    holder = layout.holder(lost, 0)
    piece = np.empty(layout.piece(lost, 0)[1], np.uint8)
    piece_1 = best_of(repeats, lambda: rebuild_piece(one, layout, lost, holder, survivors, parities[holder], piece))
    rebuilt = np.zeros(size, np.uint8)  # a hot spare's memory, faulted in beforehand
    whole = best_of(repeats, lambda: rebuild(every, layout, lost, survivors, [None] + parities[1:], out=rebuilt))
    if not np.array_equal(rebuilt, shards[lost]):
        raise SystemExit(f"parity g={members} at {size // MiB} MiB rebuilt a shard that differs from the lost one")
    held = layout.held_bytes() / size
    return dict(mode=f"parity g={members} m=1", size_mib=size // MiB, memory_x=VERSIONS + REGIONS * held,
                memory_eager_x=EAGER_VERSIONS + REGIONS * held, memory_synced_x=SYNCED_VERSIONS + REGIONS * held,
                held_for_others_x=REGIONS * held, pushed_x=layout.pushed_bytes(0) / size,
                pull_sources=members - 1, pulled_x=1.0, holder_receives_x=(members - 2) * held,
                encode_1_s=encode_1, encode_all_s=encode_all, encode_vs_memcpy_1=encode_1 / limit["memcpy_1_s"],
                rebuild_piece_1_s=piece_1, rebuild_whole_s=whole, rebuild_whole_vs_tcp=whole / limit["tcp_s"],
                rebuilt_bitwise=True)


def copy_rows(size: int) -> list:
    rows = []
    for k in (1, 2):
        rows.append(dict(mode=f"buddies k={k}", size_mib=size // MiB, memory_x=VERSIONS + REGIONS * k,
                         memory_eager_x=EAGER_VERSIONS + REGIONS * k, memory_synced_x=SYNCED_VERSIONS + REGIONS * k,
                         held_for_others_x=REGIONS * k, pushed_x=float(k), pull_sources=k, pulled_x=1.0))
    for shares in (1, 8):  # the state is replicated already: a rank snapshots 1/shares of it
        rows.append(dict(mode=f"data-parallel shares={shares}", size_mib=size // MiB, memory_x=VERSIONS / shares,
                         memory_eager_x=EAGER_VERSIONS / shares, memory_synced_x=SYNCED_VERSIONS / shares,
                         held_for_others_x=0.0, pushed_x=0.0, pull_sources=shares, pulled_x=1.0))
    return rows


def table(rows: list, limit_rows: list) -> str:
    lines = [f"{'mode':<26}{'shard':>7}{'memory':>8}{'3 vers.':>8}{'2 vers.':>8}{'others':>8}{'pushed':>8}"
             f"{'pull from':>10}{'encode 1t':>11}{'/copy':>7}{'encode all':>11}{'piece 1t':>10}{'rebuild':>9}"
             f"{'/tcp':>6}"]
    for row in rows:
        coded = ""
        if "encode_1_s" in row:
            coded = (f"{row['encode_1_s'] * 1e3:>9.1f}ms{row['encode_vs_memcpy_1']:>6.2f}x"
                     f"{row['encode_all_s'] * 1e3:>9.1f}ms{row['rebuild_piece_1_s'] * 1e3:>8.1f}ms"
                     f"{row['rebuild_whole_s'] * 1e3:>7.0f}ms{row['rebuild_whole_vs_tcp']:>5.1f}x")
        lines.append(f"{row['mode']:<26}{row['size_mib']:>5}Mi{row['memory_x']:>7.2f}x{row['memory_eager_x']:>7.2f}x"
                     f"{row['memory_synced_x']:>7.2f}x{row['held_for_others_x']:>7.2f}x"
                     f"{row['pushed_x']:>7.2f}x{row['pull_sources']:>10}{coded}")
    lines.append("")
    lines.append("limits, same run: " + "; ".join(
        f"{r['size_mib']} MiB: memcpy {r['memcpy_1_s'] * 1e3:.1f} ms (1 thread), {r['memcpy_all_s'] * 1e3:.1f} ms "
        f"(all), plain TCP {r['tcp_s'] * 1e3:.0f} ms" for r in limit_rows))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB and 256 MiB shards only")
    parser.add_argument("--sizes", type=int, nargs="+", help="shard sizes in MiB (default 64 256 1024)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES,
                        help="the snapshot's chunk, of which pieces are whole numbers (default: the job's)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "redundancy.json"))
    args = parser.parse_args(argv)
    sizes = args.sizes or ([64, 256] if args.quick else [64, 256, 1024])
    threads = _probes.available_cores()
    rows, limit_rows = [], []
    for size_mib in sizes:
        size = size_mib * MiB
        limit = limits(size, threads, args.repeats)
        limit_rows.append(dict(size_mib=size_mib, **limit))
        rows += copy_rows(size)
        rows += [parity_row(size, members, threads, args.repeats, limit, args.chunk_bytes) for members in (4, 8)]
    print(table(rows, limit_rows))
    print("memory: own versions (4; '3 vers.', '2 vers.': Job(versions=3), Job(versions=2)) + held for others, "
          "in shards (computed from the layout); pushed: bytes per version per rank, in shards; encode: a holder's "
          "XOR of its g-1 pieces; piece: one holder's share of a rebuild; rebuild: the whole lost shard in one "
          "process, vs plain TCP of the shard. m=2 (Reed-Solomon) is not built.")
    result = dict(rows=rows, limits=limit_rows, threads=threads, versions=VERSIONS, regions=REGIONS,
                  chunk_bytes=args.chunk_bytes,
                  machine=dict(cores=threads, cpu=platform.processor() or platform.machine()))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
