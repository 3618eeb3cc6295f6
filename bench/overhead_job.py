"""The job of bench/overhead.py: the demo's GPT under `peerstate run`, with every-step
capture (snapshot + replication) switched on and off in alternating blocks of
steps. Rank 0 prints ``step S MODE SECONDS CPU_SECONDS`` for each step: the time
from the start of one step to the start of the next, and the CPU time its
process (every thread: training, copy, replication, gloo) used meanwhile."""

import argparse
import json
import time

import torch
import torch.nn.functional as F

import peerstate
from peerstate.demo.model import Batches, TinyGPT, corpus

parser = argparse.ArgumentParser()
parser.add_argument("--blocks", type=int, default=8)
parser.add_argument("--block-steps", type=int, default=10)
parser.add_argument("--warmup", type=int, default=5)
parser.add_argument("--width", type=int, default=192)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--heads", type=int, default=4)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--data-parallel-shares", type=int, default=None)
parser.add_argument("--versions", type=int, default=4)
parser.add_argument("--breakdown", action="store_true", help="time the boundary's parts (see step_breakdown)")
parser.add_argument("--own-state", action="store_true",
                    help="track the state as each rank's own (data_parallel=False), as a shard is: pushed whole")
parser.add_argument("--parity-group", type=int, default=0, help="Job(parity_group=G) instead of buddies")
args = parser.parse_args()
torch.set_num_threads(1)

batches = Batches(corpus(), context=64, batch=args.batch, seed=0)
instrumented = None
if args.breakdown:
    from step_breakdown import Instrumented, copy_limit

    instrumented = Instrumented()
job = peerstate.Job(data_parallel_shares=args.data_parallel_shares, versions=args.versions,
                    parity_group=args.parity_group)
torch.manual_seed(0)
model = TinyGPT(len(batches.vocabulary), width=args.width, layers=args.layers, heads=args.heads)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
job.track(model=model, optimizer=optimizer, data_parallel=not args.own_state)
ddp = job.ddp(model)

total = args.warmup + args.blocks * args.block_steps
last = None
for step in job.steps(total):
    block = (step - args.warmup) // args.block_steps
    job.capture = step < args.warmup or block % 2 == 0  # on, off, on, off, ...
    now = (time.perf_counter(), time.process_time())
    if last is not None and job.rank == 0 and step > args.warmup:
        print(f"step {step - 1} {'on' if previous_capture else 'off'} {now[0] - last[0]!r} {now[1] - last[1]!r}",
              flush=True)
    if instrumented is not None:
        parts = instrumented.step()
        if last is not None and job.rank == 0 and step > args.warmup:
            print(f"parts {step - 1} {'on' if previous_capture else 'off'} {json.dumps(parts)}", flush=True)
    last, previous_capture = now, job.capture
    with job.guard():
        x, y = batches(step, job.rank)
        loss = F.cross_entropy(ddp(x).view(-1, len(batches.vocabulary)), y.view(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
step_bytes = job.memory()["snapshot_per_version"]
job.close()
if instrumented is not None and job.rank == 0:  # after close: the versions' memory is back (a large model)
    print(f"copy_limit {step_bytes} {copy_limit(step_bytes)!r}", flush=True)
