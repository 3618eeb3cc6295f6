"""A trainer written the way torchtitan writes one, under peerstate: its meshes
built from one world mesh (``_unflatten``, ``_flatten``) by a builder peerstate
runs again in every epoch, model parts in a list, one optimizer per part in a
container, an LR-scheduler container, a train-state ``Stateful`` and a stateful
data loader, handed to ``track()`` as a trainer hands them to DCP.

    peerstate run --nproc-per-node 4 --spares 1 examples/trainer.py --layout fsdp_tp --steps 100

``--layout fsdp_tp``: (dp_shard 2, tp 2), FSDP2 over dp_shard and tensor
parallelism over tp. ``--layout hsdp``: (dp_replicate 2, dp_shard 2), FSDP2
over dp_shard replicated over dp_replicate (the replica is the free copy of
each shard: ``track(data_parallel="dp_replicate")``). ``--layout pp``: (pp 2,
dp_replicate 2), four pipeline stages looped over the two "pp" ranks (each rank
holds two model parts, stages r and r + 2, under ``ScheduleInterleaved1F1B``),
gradients averaged over dp_replicate; the schedule is built again after each
recovery, as ``pipeline.py`` says why. Kill any rank (its pid is printed): a
spare takes its place with its state.

The containers here have torchtitan's shape (``OptimizersContainer.optimizers``,
``LRSchedulersContainer.schedulers``); torchtitan itself is not imported, so
this runs on the pinned CPU torch.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import peerstate

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--layout", choices=["fsdp_tp", "hsdp", "pp"], default="fsdp_tp")
parser.add_argument("--width", type=int, default=64, help="the hidden layers' width")
parser.add_argument("--out", default=None, help="a folder: each rank writes its final state there")
parser.add_argument("--step-seconds", type=float, default=0.0, help="extra time per step, to watch faults land")
args = parser.parse_args()

LAYOUTS = {"fsdp_tp": (("dp_shard", 2), ("tp", 2)), "hsdp": (("dp_replicate", 2), ("dp_shard", 2)),
           "pp": (("pp", 2), ("dp_replicate", 2))}
MICROBATCHES = 4


class ParallelDims:
    """Which meshes the trainer uses, all derived from one world mesh (as torchtitan's
    ``ParallelDims.build_mesh``)."""

    def __init__(self, layout, device_type):
        self.layout, self.device_type = layout, device_type

    def build_mesh(self):
        world = init_device_mesh(self.device_type, (dist.get_world_size(),), mesh_dim_names=("world",))
        names = tuple(name for name, _ in self.layout)
        mesh = world._unflatten(0, tuple(size for _, size in self.layout), names)
        data = tuple(name for name in names if name.startswith("dp"))
        return {"mesh": mesh, "dp": mesh[data]._flatten("dp") if len(data) > 1 else mesh[data[0]]}


class OptimizersContainer(torch.optim.Optimizer):
    """One optimizer per model part (torchtitan's shape: an Optimizer itself, for its
    hooks, whose own ``state`` stays empty)."""

    def __init__(self, parts, **options):
        self.optimizers = [torch.optim.AdamW(part.parameters(), **options) for part in parts]
        torch.optim.Optimizer.__init__(self, [p for part in parts for p in part.parameters()], options)

    def step(self, closure=None):
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none=True):
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


class LRSchedulersContainer:
    def __init__(self, optimizers):
        self.schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=7, gamma=0.7) for o in optimizers.optimizers]

    def step(self):
        for scheduler in self.schedulers:
            scheduler.step()

    def state_dict(self):
        return {str(i): s.state_dict() for i, s in enumerate(self.schedulers)}

    def load_state_dict(self, state):
        for i, scheduler in enumerate(self.schedulers):
            scheduler.load_state_dict(state[str(i)])


class TrainState:
    """The trainer's own counters (a DCP ``Stateful``)."""

    def __init__(self):
        self.step, self.tokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state):
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]


class StatefulLoader:
    """Batches addressed by position: what it hands out next is its state."""

    def __init__(self, data_rank):
        self.data_rank, self.position = data_rank, 0

    def next_batch(self):
        generator = torch.Generator().manual_seed(1000 * self.position + self.data_rank)
        self.position += 1
        return torch.randn(16, 32, generator=generator), torch.randn(16, 32, generator=generator)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


device_type = "cuda" if torch.cuda.is_available() else "cpu"
job = peerstate.Job()
dims = ParallelDims(LAYOUTS[args.layout], device_type)
built = job.build_meshes(dims.build_mesh, layout=dims.layout)

torch.manual_seed(0)
widths = [32, args.width, args.width, args.width, 32]
stages = [torch.nn.Sequential(torch.nn.Linear(widths[i], widths[i + 1]), *([torch.nn.GELU()] if i < 3 else []))
          for i in range(4)]
job.wait_for_rank()  # the meshes exist once this process has a rank
mesh = built.value["mesh"]
if "pp" in mesh.mesh_dim_names:  # this rank's stages, looped: r and r + 2
    owned = [mesh.get_local_rank("pp"), mesh.get_local_rank("pp") + 2]
    parts = [stages[i] for i in owned]
else:  # the whole model, in two parts
    owned, parts = [], [torch.nn.Sequential(*stages[:2]), torch.nn.Sequential(*stages[2:])]
if device_type == "cuda":
    parts = [part.to(torch.cuda.current_device()) for part in parts]
if "tp" in mesh.mesh_dim_names:  # src_data_rank=None: each rank shards its own copy (see fsdp_tp.py)
    parallelize_module(parts[0], mesh["tp"], {"0.0": ColwiseParallel(), "1.0": RowwiseParallel()}, src_data_rank=None)
    parallelize_module(parts[1], mesh["tp"], {"0.0": ColwiseParallel(), "1.0": RowwiseParallel()}, src_data_rank=None)
if "dp_shard" in mesh.mesh_dim_names:
    shard_mesh = mesh["dp_replicate", "dp_shard"] if "dp_replicate" in mesh.mesh_dim_names else mesh["dp_shard"]
    for part in parts:
        fully_shard(part, mesh=shard_mesh)
optimizers = OptimizersContainer(parts, lr=1e-2)
schedulers = LRSchedulersContainer(optimizers)
train_state = TrainState()
loader = StatefulLoader(built.value["dp"].get_local_rank())  # a tensor-parallel group shares its batches
job.track(model=parts, optimizer=optimizers, scheduler=schedulers, loader=loader, extras={"train_state": train_state},
          data_parallel="dp_replicate" if "dp_replicate" in mesh.mesh_dim_names else False)
print(f"rank {job.rank} pid {os.getpid()}", flush=True)


def build_schedule():
    """The pipeline over this epoch's "pp" group (built again after each recovery)."""
    group = mesh.get_group("pp")
    device = torch.device(device_type)
    pipeline = [PipelineStage(part, index, len(stages), device, group=group) for part, index in zip(parts, owned)]
    return ScheduleInterleaved1F1B(pipeline, n_microbatches=MICROBATCHES, loss_fn=F.mse_loss)


schedule, built_after = (build_schedule(), job.recoveries) if owned else (None, None)

for step in job.steps(args.steps):
    if schedule is not None and job.recoveries != built_after:
        schedule, built_after = build_schedule(), job.recoveries
    with job.guard():
        x, y = loader.next_batch()
        if schedule is None:
            out = x.to(device_type)
            for part in parts:
                out = part(out)
            loss = F.mse_loss(out, y.to(device_type))
            loss.backward()
        else:
            losses = []
            schedule.step(x.to(device_type), target=y.to(device_type), losses=losses)
            loss = torch.stack(losses).mean() if losses else torch.zeros(())
            for part in parts:  # average the pipeline replicas' gradients
                for parameter in part.parameters():
                    dist.all_reduce(parameter.grad, group=mesh.get_group("dp_replicate"))
                    parameter.grad /= mesh.size(mesh.mesh_dim_names.index("dp_replicate"))
        time.sleep(args.step_seconds)
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        train_state.step += 1
        train_state.tokens_seen += x.numel()
    print(f"rank {job.rank} step {step} loss {loss.item():.6f}", flush=True)

if args.out:
    final = {f"part{i}/{name}": (value.to_local() if hasattr(value, "to_local") else value).cpu()
             for i, part in enumerate(parts) for name, value in part.state_dict().items()}
    final.update({f"optimizer{i}/{index}/{key}": (value.to_local() if hasattr(value, "to_local") else value).cpu()
                  for i, optimizer in enumerate(optimizers.optimizers)
                  for index, state in enumerate(optimizer.state.values()) for key, value in state.items()})
    final["train_state"] = torch.tensor([train_state.step, train_state.tokens_seen, loader.position])
    torch.save(final, os.path.join(args.out, f"rank{job.rank}.pt"))
job.close()
