"""The training job of bench/recovery.py, in two modes.

- ``--mode peerstate``: under ``peerstate run``; a failure is recovered in place.
- ``--mode restart``: plain torch.distributed, the classic way: a torch.save
  checkpoint on local disk every ``--checkpoint-every`` steps, and after a
  failure every worker is started again and loads it (``--resume``).

State per rank: a small MLP trained with AdamW plus a frozen table (a model
buffer) that brings the state to ``--state-mib``. Each line ``step S T`` says
step S finished at time T; restart mode also prints ``started T`` (process up,
group formed) and ``loaded T`` (checkpoint read).
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=["peerstate", "restart"], required=True)
parser.add_argument("--state-mib", type=int, default=256)
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--step-seconds", type=float, default=0.05)
parser.add_argument("--checkpoint-dir", default=None)
parser.add_argument("--checkpoint-every", type=int, default=10)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--data-parallel-shares", type=int, default=None, help="peerstate: Job(data_parallel_shares=N)")
parser.add_argument("--replicated", action="store_true", help="peerstate: send all state to the buddies "
                    "(default: data_parallel=True, the model state comes from any surviving rank)")
parser.add_argument("--parity-group", type=int, default=0, help="peerstate: Job(parity_group=G) (with --replicated)")
args = parser.parse_args()
torch.set_num_threads(1)


class Model(torch.nn.Module):
    def __init__(self, state_bytes: int) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
        trained = sum(p.numel() for p in self.mlp.parameters()) * 4 * 3  # params + 2 AdamW moments
        self.register_buffer("table", torch.rand(max(state_bytes - trained, 4) // 4))

    def forward(self, x):
        return self.mlp(x) + self.table[:8]


def batch(step, rank):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(64, 64, generator=generator), torch.randn(64, 8, generator=generator)


def train_step(ddp, optimizer, step, rank):
    x, y = batch(step, rank)
    loss = F.mse_loss(ddp(x), y)
    optimizer.zero_grad()
    loss.backward()
    time.sleep(args.step_seconds)
    optimizer.step()


torch.manual_seed(0)
if args.mode == "peerstate":
    import peerstate

    job = peerstate.Job(data_parallel_shares=args.data_parallel_shares, parity_group=args.parity_group)
    model = Model(args.state_mib << 20)
    optimizer = torch.optim.AdamW(model.mlp.parameters(), lr=1e-3)
    job.track(model=model, optimizer=optimizer, data_parallel=not args.replicated)  # a spare waits here
    ddp = job.ddp(model, broadcast_buffers=False)
    for step in job.steps(args.steps):
        with job.guard():
            train_step(ddp, optimizer, step, job.rank)
        print(f"step {step} {time.time()}", flush=True)
    job.close()
else:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    model = Model(args.state_mib << 20)
    optimizer = torch.optim.AdamW(model.mlp.parameters(), lr=1e-3)
    ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    print(f"started {time.time()}", flush=True)
    path = os.path.join(args.checkpoint_dir, f"rank{rank}.pt")
    start = 0
    if args.resume:
        state = torch.load(path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"] + 1
        print(f"loaded {time.time()}", flush=True)
    for step in range(start, args.steps):
        train_step(ddp, optimizer, step, rank)
        if step % args.checkpoint_every == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, path + ".tmp")
            os.replace(path + ".tmp", path)
        print(f"step {step} {time.time()}", flush=True)
    dist.destroy_process_group()
