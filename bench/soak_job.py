"""The soak's training job (``bench/soak.py``): the demo's GPT under DDP with
peerstate, each step at least ``--step-seconds`` long (the rest of the step is
slept, standing in for a larger model's compute, so that a round's length in
seconds, where its faults fall, is known in steps). With ``--step-seconds 0``
it is the fault-free reference. A new job started on the same
``--checkpoint-dir`` resumes after its newest checkpoint, so rounds chain.

Rank 0 writes the final parameters to ``--out``."""

import argparse
import faulthandler
import os
import signal
import time

import torch

import peerstate
from peerstate.demo.model import Batches, build, corpus, train_step

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--out", required=True, help="the final parameters (rank 0)")
parser.add_argument("--step-seconds", type=float, default=0.1)
parser.add_argument("--width", type=int, default=128)
parser.add_argument("--layers", type=int, default=2)
args = parser.parse_args()

faulthandler.register(signal.SIGUSR2, all_threads=True)  # the soak's dump of a stalled recovery (soak.py)
torch.set_num_threads(1)
batches = Batches(corpus(seed=0), context=64, batch=8, seed=0)
job = peerstate.Job()
model, optimizer, scheduler = build(len(batches.vocabulary), args.width, args.layers, seed=0)
job.track(model=model, optimizer=optimizer, scheduler=scheduler, data_parallel=True)
ddp = job.ddp(model)
print(f"rank {job.rank} pid {os.getpid()}", flush=True)
for step in job.steps(args.steps):
    with job.guard():
        started = time.monotonic()
        train_step(ddp, optimizer, scheduler, batches, step, job.rank)
        time.sleep(max(0.0, args.step_seconds - (time.monotonic() - started)))
    print(f"rank {job.rank} step {step}", flush=True)
if job.rank == 0:
    torch.save({name: value.clone() for name, value in model.state_dict().items()}, args.out)
job.close()
