"""FSDP2 with tensor parallelism under peerstate (torchtitan's shape): a 2-D
DeviceMesh ("dp", "tp"), the MLP split column-wise then row-wise over "tp"
(``parallelize_module``), and every tensor-parallel shard sharded again over "dp".

    peerstate run --nproc-per-node 4 --spares 1 examples/fsdp_tp.py --steps 100

Kill any rank (its pid is printed): a spare takes its place with its shard.
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import peerstate

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (divides the world size)")
parser.add_argument("--width", type=int, default=128, help="the hidden layers' width")
parser.add_argument("--out", default=None, help="a folder: each rank writes its final shards there")
parser.add_argument("--step-seconds", type=float, default=0.0, help="extra time per step, to watch faults land")
args = parser.parse_args()

device_type = "cuda" if torch.cuda.is_available() else "cpu"
job = peerstate.Job()
mesh = job.device_mesh(device_type, (job.world_size // args.tp, args.tp), mesh_dim_names=("dp", "tp"))

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, args.width), torch.nn.GELU(), torch.nn.Linear(args.width, 32))
job.wait_for_rank()  # parallelize_module and fully_shard need the mesh's groups
if device_type == "cuda":
    model.to(torch.cuda.current_device())
# src_data_rank=None: every rank shards its own copy (seeded alike) instead of receiving rank 0's. A
# replacement runs this while the survivors train: a scatter from rank 0 would wait for them in vain.
parallelize_module(model, mesh.mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()}, src_data_rank=None)
fully_shard(model, mesh=mesh.mesh["dp"])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
job.track(model=model, optimizer=optimizer)
print(f"rank {job.rank} pid {os.getpid()}", flush=True)
data_rank = mesh.mesh.get_local_rank("dp")  # the ranks of one tensor-parallel group share a batch

for step in job.steps(args.steps):
    with job.guard():
        generator = torch.Generator().manual_seed(1000 * step + data_rank)
        x = torch.randn(16, 32, generator=generator).to(device_type)
        y = torch.randn(16, 32, generator=generator).to(device_type)
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
