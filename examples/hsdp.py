"""HSDP under peerstate: FSDP2 on a 2-D DeviceMesh, 2 replica groups x N/2 shards.

    peerstate run --nproc-per-node 4 --spares 1 examples/hsdp.py --steps 100

Each rank holds a shard of the model and of AdamW's state, the same shard as
the rank at the same place of the other replica group: ``track(data_parallel=
"replicate")`` says so, and peerstate uses that replica as the shard's copy
(no replication traffic, no replica memory). Kill any rank (its pid is
printed) and a spare takes its place with its shard, pulled from the rank at
its place in the other replica group, and its own RNG state from its buddy;
the other ranks stay in their processes.
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import peerstate

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--width", type=int, default=128, help="the hidden layers' width")
parser.add_argument("--out", default=None, help="a folder: each rank writes its final shards there")
parser.add_argument("--step-seconds", type=float, default=0.0, help="extra time per step, to watch faults land")
args = parser.parse_args()

device_type = "cuda" if torch.cuda.is_available() else "cpu"
job = peerstate.Job()
# Declared before track(): peerstate aborts the mesh's groups on a failure and re-forms them.
mesh = job.device_mesh(device_type, (2, job.world_size // 2), mesh_dim_names=("replicate", "shard"))

torch.manual_seed(0)  # before track(): a replacement's restored RNG state must not be overwritten
model = torch.nn.Sequential(torch.nn.Linear(32, args.width), torch.nn.GELU(), torch.nn.Linear(args.width, 32),
                            torch.nn.GELU(), torch.nn.Linear(32, 8))
job.wait_for_rank()  # fully_shard needs the mesh: a spare shards its model once it has a rank
if device_type == "cuda":
    model.to(torch.cuda.current_device())
for layer in model[::2]:
    fully_shard(layer, mesh=mesh.mesh)
fully_shard(model, mesh=mesh.mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
# The shard is the same along "replicate": those ranks are each other's copies of it.
job.track(model=model, optimizer=optimizer, data_parallel="replicate")
print(f"rank {job.rank} pid {os.getpid()}", flush=True)

for step in job.steps(args.steps):
    with job.guard():
        # Every rank is a data-parallel rank: its batch is a function of (step, rank).
        generator = torch.Generator().manual_seed(1000 * step + job.rank)
        x = torch.randn(16, 32, generator=generator).to(device_type)
        y = torch.randn(16, 8, generator=generator).to(device_type)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        time.sleep(args.step_seconds)
        optimizer.step()
        optimizer.zero_grad()
    print(f"rank {job.rank} step {step} loss {loss.item():.6f}", flush=True)

if args.out:
    shards = {name: value.to_local().cpu() for name, value in model.state_dict().items()}
    torch.save(shards, os.path.join(args.out, f"rank{job.rank}.pt"))
job.close()
