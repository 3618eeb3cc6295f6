"""The demo's training job: a small GPT trained with DDP under `peerstate run`.

Each rank prints ``loss STEP VALUE`` (rank 0) and ``rank R step S`` lines;
at the end rank 0 writes the final parameters, and every rank its state as a
torch.save checkpoint (what a classic restart would load). With
``--restart-from DIR`` it is instead a plain torch.distributed worker that
loads that checkpoint and runs one step: the demo's restart baseline.
"""

import argparse
import os
import sys
import time

import torch

from peerstate.demo.model import Batches, build, corpus, train_step

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--out", required=True, help="a folder for the final parameters and checkpoints")
parser.add_argument("--width", type=int, default=192)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--restart-from", default=None, help="baseline: load this checkpoint folder, run one step")
parser.add_argument("--device", default="cpu", help="where the model and its optimizer state live (cuda: device "
                    "snapshots through the CUDA copy engine)")
parser.add_argument("--backend", default="gloo", help="the process groups' backend (gloo also serves CUDA "
                    "tensors, and several ranks on one GPU, which NCCL refuses)")
args = parser.parse_args()

torch.set_num_threads(1)
if args.device.startswith("cuda"):  # bitwise on a GPU: deterministic kernels, the math attention
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
batches = Batches(corpus(seed=args.seed), context=64, batch=args.batch, seed=args.seed)


if args.restart_from:  # the classic way: a fresh process loads a checkpoint from disk
    import torch.distributed as dist

    started = time.time()
    rank = int(os.environ["RANK"])
    dist.init_process_group(args.backend)
    model, optimizer, scheduler = build(len(batches.vocabulary), args.width, args.layers, args.seed)
    ddp = torch.nn.parallel.DistributedDataParallel(model.to(args.device))
    state = torch.load(os.path.join(args.restart_from, f"rank{rank}.pt"), map_location=args.device)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    loaded = time.time()
    train_step(ddp, optimizer, scheduler, batches, state["step"] + 1, rank)
    print(f"baseline started {started} loaded {loaded} stepped {time.time()}", flush=True)
    dist.destroy_process_group()
    sys.exit(0)

import peerstate  # noqa: E402

job = peerstate.Job(backend=args.backend)
model, optimizer, scheduler = build(len(batches.vocabulary), args.width, args.layers, args.seed)
model.to(args.device)  # in place: the optimizer keeps the same parameters
job.track(model=model, optimizer=optimizer, scheduler=scheduler, data_parallel=True)  # a spare waits here
ddp = job.ddp(model)
print(f"rank {job.rank} pid {os.getpid()}", flush=True)
for step in job.steps(args.steps):
    with job.guard():
        loss = train_step(ddp, optimizer, scheduler, batches, step, job.rank)
        if job.rank == 0:
            print(f"loss {step} {loss!r} {time.time()}", flush=True)
        print(f"rank {job.rank} step {step}", flush=True)

os.makedirs(os.path.join(args.out, "checkpoint"), exist_ok=True)
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "step": args.steps - 1}, os.path.join(args.out, "checkpoint", f"rank{job.rank}.pt"))
if job.rank == 0:
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(args.out, "final.pt"))
job.close()
