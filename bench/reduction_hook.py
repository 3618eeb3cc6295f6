"""What peerstate's abortable bucket reduction costs a DDP step.

``job.ddp()`` reduces DDP's buckets through a comm hook of peerstate's
(``worker/rebuild.py``: scale by 1 / group size, sum with an async all_reduce,
and a future of its own that an abort can fail) where a plain DDP reduces in
C++ with no Python per bucket. This bench measures the difference on the
demo's GPT: ``--ranks`` processes on one gloo group (127.0.0.1), each with three
copies of the same model: one in a plain ``DistributedDataParallel``, one in
peerstate's (``new_rebuildable_ddp``), and one in a DDP with torch's own Python
``allreduce_hook`` (the peer: what any comm hook costs). They are stepped in
alternating blocks (plain, peerstate, plain, torch's hook, plain, ...) so that
all see the same machine, with DDP's default buckets and with small ones (13
buckets instead of 2). Each hooked block is compared with the plain blocks
beside it (as ``bench/overhead.py`` compares capture on and off). Before timing, both copies
take the same step on the same batches and their reduced gradients are
compared bit for bit (the run stops if they differ).

Measured: a forward and backward (the reduction included; no optimizer step)
per step, wall time and the CPU time of rank 0's process (every thread).

    python bench/reduction_hook.py [--quick] [--ranks N]   # bench/results/reduction_hook.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "reduction_hook.json"
BUCKETS = {"default buckets (25 MB)": None, "small buckets (0.25 MB)": 0.25}


def member(rank: int, world: int, port: int, blocks: int, block_steps: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from peerstate.demo.model import Batches, TinyGPT, corpus
    from peerstate.worker.rebuild import new_rebuildable_ddp

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    batches = Batches(corpus(), context=64, batch=8, seed=0)
    vocabulary = len(batches.vocabulary)

    def model():
        torch.manual_seed(0)
        return TinyGPT(vocabulary, width=192, layers=4)

    def step(ddp, index: int) -> None:
        for parameter in ddp.module.parameters():
            parameter.grad = None
        x, y = batches(index, rank)
        F.cross_entropy(ddp(x).view(-1, vocabulary), y.view(-1)).backward()

    for label, cap in BUCKETS.items():
        options = {} if cap is None else {"bucket_cap_mb": cap}
        plain = DistributedDataParallel(model(), **options)
        python_hook = DistributedDataParallel(model(), **options)
        python_hook.register_comm_hook(None, default_hooks.allreduce_hook)
        ours = new_rebuildable_ddp(model(), init_sync=True, options=options)
        for index in range(3):  # DDP re-buckets after its first iteration (logged at the next); all settle first
            for ddp in (plain, python_hook, ours):
                step(ddp, index)
            for a, b in zip(plain.module.parameters(), ours.module.parameters()):
                if not torch.equal(a.grad, b.grad):
                    raise SystemExit(f"rank {rank}: the reduced gradients differ ({label}, step {index})")
        buckets = len(ours.bucket_layout())
        for block in range(4 * blocks):  # plain, peerstate, plain, torch's hook, plain, ...
            ddp, mode = ((plain, "plain") if block % 2 == 0 else (ours, "peerstate") if block % 4 == 1 else
                         (python_hook, "torch-hook"))
            for index in range(block_steps):
                now = (time.perf_counter(), time.process_time())
                step(ddp, index)
                done = (time.perf_counter(), time.process_time())
                if rank == 0:
                    print(f"step {label}|{buckets}|{mode} {done[0] - now[0]!r} {done[1] - now[1]!r}", flush=True)
    dist.destroy_process_group()


def run(ranks: int, blocks: int, block_steps: int, timeout: float) -> str:
    from peerstate.control.kvstore import TorchKeyValueStore

    store = TorchKeyValueStore("127.0.0.1", 0, host_store=True)  # listens on loopback only
    environment = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    members = [subprocess.Popen([sys.executable, __file__, "--member", str(rank), "--world", str(ranks),
                                 "--port", str(store.port), "--blocks", str(blocks), "--block-steps",
                                 str(block_steps)], stdout=subprocess.PIPE if rank == 0 else None, text=True,
                                env=environment)
               for rank in range(ranks)]
    try:
        output = members[0].communicate(timeout=timeout)[0]
        for process in members[1:]:
            process.wait(timeout=60)
    finally:
        for process in members:
            process.kill()
            process.wait()
    if any(process.returncode != 0 for process in members):
        raise RuntimeError(f"a member failed ({[p.returncode for p in members]}); rank 0 printed:\n{output[-2000:]}")
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="12 blocks of 8 steps (default: 32 of 12)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--member", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--blocks", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--block-steps", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.member is not None:
        member(args.member, args.world, args.port, args.blocks, args.block_steps)
        return
    sys.path.insert(0, str(HERE))
    from overhead import block_overheads, summarize

    blocks, block_steps = (3, 8) if args.quick else (8, 12)
    print(f"bucket reduction through a comm hook against a plain DDP's: demo GPT, {args.ranks} ranks on gloo, "
          f"{os.cpu_count()} cores, {4 * blocks} alternating blocks of {block_steps} steps (plain, peerstate, "
          "plain, torch's hook, ...); peerstate's reduced gradients bitwise equal to plain DDP's: checked")
    output = run(args.ranks, blocks, block_steps, timeout=1800.0)
    steps = re.findall(r"^step (.+)\|(\d+)\|(\S+) (\S+) (\S+)$", output, re.M)
    rows = []
    print(f"{'buckets':<26}{'count':>6}{'measure':>8}{'plain DDP':>11}{'hooked':>10}{'ratio':>8}"
          f"{'overhead: mean of block pairs':>31}{'std':>7}   hook")
    for label in BUCKETS:
        for hook, name in (("peerstate", "peerstate's (abortable)"), ("torch-hook", "torch's allreduce_hook")):
            # Each hooked block against the plain blocks beside it (the other hook's blocks left out).
            mine = [s for s in steps if s[0] == label and s[2] in ("plain", hook)]
            for measure, column in (("wall", 3), ("CPU", 4)):
                summary = summarize(block_overheads([("on" if s[2] == hook else "off", float(s[column]))
                                                     for s in mine]))
                row = {"case": label, "hook": name, "buckets": int(mine[0][1]), "measure": measure,
                       "ours_s": summary["capture_on_s"], "baseline_s": summary["capture_off_s"],
                       "ratio": summary["capture_on_s"] / summary["capture_off_s"],
                       "overhead_percent": summary["overhead_percent"], "spread_percent": summary["spread_percent"],
                       "pairs": summary["pairs"]}
                rows.append(row)
                print(f"{label:<26}{row['buckets']:>6}{measure:>8}{row['baseline_s']:>10.4f}s{row['ours_s']:>9.4f}s"
                      f"{row['ratio']:>8.3f}{row['overhead_percent']:>+30.2f}%{row['spread_percent']:>6.2f}%   {name}")
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "benchmark": "reduction_hook", "time": time.time(), "ranks": args.ranks, "cores": os.cpu_count(),
        "command": " ".join(["python", "bench/reduction_hook.py", *sys.argv[1:]]), "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
