"""A 2-stage pipeline under peerstate (``torch.distributed.pipelining``, 1F1B),
replicated data-parallel: a 2-D DeviceMesh ("dp", "pp"), each rank one stage of
one pipeline, gradients averaged over "dp".

    peerstate run --nproc-per-node 4 --spares 1 examples/pipeline.py --steps 100

Kill any rank (its pid is printed): a spare takes its stage, pulled from the
rank that holds the same stage in the other pipeline (``track(data_parallel=
"dp")``: a stage's weights are the same along "dp"), and its own RNG state
from its buddy.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import peerstate

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--width", type=int, default=64, help="the hidden layers' width")
parser.add_argument("--out", default=None, help="a folder: each rank writes its final stage there")
parser.add_argument("--step-seconds", type=float, default=0.0, help="extra time per step, to watch faults land")
args = parser.parse_args()

BATCH, MICROBATCHES, WIDTH = 16, 4, args.width
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
job = peerstate.Job()
mesh = job.device_mesh(device.type, (job.world_size // 2, 2), mesh_dim_names=("dp", "pp"))

torch.manual_seed(0)
stages = [torch.nn.Sequential(torch.nn.Linear(32, WIDTH), torch.nn.GELU()),
          torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, 8))]
job.wait_for_rank()  # which stage this process holds depends on its rank
stage_index = mesh.mesh.get_local_rank("pp")
module = stages[stage_index].to(device)
optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
job.track(model=module, optimizer=optimizer, data_parallel="dp")  # a stage is the same along "dp": its copies
print(f"rank {job.rank} pid {os.getpid()}", flush=True)


def build_schedule():
    """The stage and its schedule over this epoch's "pp" group. A schedule's first step
    exchanges shapes with the neighbour stage: a survivor builds its schedule again after
    each recovery, so that it makes that exchange together with the replacement's (and
    holds this epoch's group, not the aborted one)."""
    stage = PipelineStage(module, stage_index, 2, device, group=mesh.get_group("pp"))
    return Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=F.mse_loss)


schedule, built_after = build_schedule(), job.recoveries

for step in job.steps(args.steps):
    if job.recoveries != built_after:
        schedule, built_after = build_schedule(), job.recoveries
    with job.guard():
        generator = torch.Generator().manual_seed(1000 * step + mesh.mesh.get_local_rank("dp"))
        x = torch.randn(BATCH, 32, generator=generator).to(device)
        y = torch.randn(BATCH, 8, generator=generator).to(device)
        losses = []
        if stage_index == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        for parameter in module.parameters():  # average the replicas' gradients
            dist.all_reduce(parameter.grad, group=mesh.get_group("dp"))
            parameter.grad /= mesh.mesh.size(0)
        time.sleep(args.step_seconds)
        optimizer.step()
        optimizer.zero_grad()
    loss = f" loss {sum(loss.item() for loss in losses) / len(losses):.6f}" if losses else ""
    print(f"rank {job.rank} step {step}{loss}", flush=True)

if args.out:
    torch.save({name: value.cpu() for name, value in module.state_dict().items()},
               os.path.join(args.out, f"rank{job.rank}.pt"))
job.close()
