"""A small DDP training job under peerstate, for the launcher and recovery tests.

Every batch is a function of (seed, step, rank), so a replayed step sees the
same data. At the end rank 0 writes the final parameters to --out.
"""

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import peerstate

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--step-seconds", type=float, default=0.05, help="extra time per step, so faults land mid-run")
parser.add_argument("--out", default=None)
parser.add_argument("--fail-at-import", action="store_true")
parser.add_argument("--data-parallel", action="store_true", help="track(data_parallel=True)")
parser.add_argument("--data-parallel-shares", type=int, default=None, help="Job(data_parallel_shares=N)")
parser.add_argument("--versions", type=int, default=4, help="Job(versions=N): 3 runs the eager pipeline, 2 the synced one")
parser.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (fully_shard) instead of DDP")
parser.add_argument("--parity-group", type=int, default=0, help="Job(parity_group=G): parity groups, not buddies")
parser.add_argument("--trace", action="store_true", help="print a digest of the parameters at each step")
parser.add_argument("--width", type=int, default=64)
parser.add_argument("--subgroups", action="store_true",
                    help="each step, an allreduce in subgroups [1, 3] then [0, 1] before the DDP step")
parser.add_argument("--hold", default=None, metavar="RANK:STEP",
                    help="RANK sleeps at the start of STEP, in its first life only (a call no abort wakes)")
parser.add_argument("--hold-after", default=None, metavar="RANK:STEP",
                    help="RANK sleeps at the end of STEP, after its collectives and optimizer step (first life only)")
parser.add_argument("--raise-at", default=None, metavar="RANK:STEP[:always]",
                    help="RANK raises an exception in STEP, in an initial worker only (its replacement does not), "
                         "or with :always in every worker that holds RANK")
parser.add_argument("--raise-in-restore", type=int, default=None, metavar="RANK",
                    help="every replacement of RANK raises while its state is restored (a tracked extra's "
                         "load_state_dict), in track()")
parser.add_argument("--hold-gil", default=None, metavar="RANK:SECONDS",
                    help="RANK holds the GIL for SECONDS before its first step, as some of torch's setup "
                         "collectives do while they wait for a slower peer (its heartbeat thread stands still)")
parser.add_argument("--hold-gil-at", default=None, metavar="RANK:STEP:SECONDS",
                    help="RANK holds the GIL for SECONDS in STEP, in an initial worker only (its heartbeat stops)")
parser.add_argument("--sleep-after-loop", type=float, default=0.0, help="seconds between the loop and close()")
parser.add_argument("--sleep-after-loop-rank", type=int, default=None, help="only this rank sleeps after the loop")
parser.add_argument("--abort-timeout", type=float, default=30.0)
parser.add_argument("--failure-grace", type=float, default=20.0)
parser.add_argument("--replacement-busy", default=None, metavar="RANK:SECONDS",
                    help="the first replacement of RANK (a spare that took it) is busy this long in its first step")
parser.add_argument("--prefetch", action="store_true",
                    help="draw each step's noise from the global RNG a step ahead, the first right after track()")
parser.add_argument("--busy", default=None, metavar="RANK:STEP:SECONDS",
                    help="RANK sleeps SECONDS inside STEP whenever it runs it (an evaluation on one rank)")
parser.add_argument("--zero-grad-after-step", action="store_true",
                    help="zero the gradients after optimizer.step() (a common loop) instead of before backward")
parser.add_argument("--seed-after-track", action="store_true",
                    help="torch.manual_seed(rank) after track(), which overwrites a replacement's restored RNG")
parser.add_argument("--read-rank-early", action="store_true",
                    help="read RANK between Job() and track(), which a hot spare does not have yet")
parser.add_argument("--undeclared-group", action="store_true",
                    help="create a group with torch.distributed.new_group after track(), which peerstate cannot abort")
parser.add_argument("--init-process-group", choices=["before", "after"], default=None,
                    help="call torch.distributed.init_process_group before or after peerstate.Job()")
parser.add_argument("--pg-timeout", type=float, default=None, metavar="SECONDS",
                    help="after step 1, set every group's timeout to SECONDS, as torchtitan's set_pg_timeouts does")
parser.add_argument("--collective-outside-guard", action="store_true",
                    help="after step 1, all_reduce a metric between the guards (no recovery reaches it there)")
parser.add_argument("--draw-after-guard", action="store_true",
                    help="after each step's guard, draw from the global RNG (a sampling evaluation), where a "
                         "recovery does not draw again")
parser.add_argument("--step-function", action="store_true",
                    help="run each step through the job.guarded decorator instead of `with job.guard():`")
parser.add_argument("--report-ports", action="store_true",
                    help="at the end, print how many TCP ports this process listens on at PEERSTATE_HOST")
args = parser.parse_args()
if args.fail_at_import:
    raise ImportError("this script was told to fail at start-up")

torch.set_num_threads(1)
if args.init_process_group == "before":
    torch.distributed.init_process_group("gloo")
job = peerstate.Job(join_timeout=60.0, failure_grace=args.failure_grace, abort_timeout=args.abort_timeout,
                    data_parallel_shares=args.data_parallel_shares, versions=args.versions,
                    parity_group=args.parity_group)
if args.init_process_group == "after":
    torch.distributed.init_process_group("gloo")
hold_rank, hold_step = map(int, args.hold.split(":")) if args.hold else (None, None)
late_rank, late_step = map(int, args.hold_after.split(":")) if args.hold_after else (None, None)
busy_rank, busy_step, busy_seconds = (float(v) for v in args.busy.split(":")) if args.busy else (None, None, 0)
raise_rank, raise_step = map(int, args.raise_at.split(":")[:2]) if args.raise_at else (None, None)
raise_always = bool(args.raise_at) and args.raise_at.endswith(":always")
LAUNCH_VARIABLES = ("PEERSTATE_ROLE", "RANK", "LOCAL_RANK", "OMP_NUM_THREADS")
print("environment before track:", " ".join(f"{v}={os.environ.get(v, '-')}" for v in LAUNCH_VARIABLES), flush=True)
if args.read_rank_early:
    int(os.environ["RANK"])
if args.fsdp:
    job.wait_for_rank()  # fully_shard needs the process group: a spare builds its model once picked
if args.subgroups:  # long timeouts: only an abort gets a blocked member out in time
    pair_1_3 = job.new_group([1, 3], timeout=datetime.timedelta(seconds=600))
    pair_0_1 = job.new_group([0, 1], timeout=datetime.timedelta(seconds=600))


def listening_ports(host):
    """The TCP ports this process listens on at ``host`` (IPv4), from /proc."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    address = "".join(f"{int(part):02X}" for part in reversed(host.split(".")))
    ports = []
    with open("/proc/self/net/tcp") as table:
        for line in list(table)[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes and local.split(":")[0] == address:
                ports.append(int(local.split(":")[1], 16))
    return ports


def subgroup_collectives(step):
    """Rank 1 waits on rank 3, then rank 0 waits on rank 1."""
    for subgroup, expected in ((pair_1_3, 4), (pair_0_1, 1)):
        if job.rank in subgroup.ranks:
            total = torch.tensor([job.rank])
            dist.all_reduce(total, group=subgroup.group)
            assert int(total) == expected, (subgroup.ranks, int(total))


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, args.width), torch.nn.Tanh(), torch.nn.Linear(args.width, 4))
if args.fsdp:
    from torch.distributed.fsdp import fully_shard

    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.7)


class FailsInReplacements:
    """A tracked extra whose restore raises in every replacement of --raise-in-restore."""

    def state_dict(self):
        return {"calls": torch.zeros(1)}

    def load_state_dict(self, state):
        if job.rank == args.raise_in_restore and os.environ["PEERSTATE_ROLE"] != "worker":
            raise RuntimeError(f"the restore of rank {job.rank} was told to fail")


extras = {"fails": FailsInReplacements()} if args.raise_in_restore is not None else None
job.track(model=model, optimizer=optimizer, scheduler=scheduler, data_parallel=args.data_parallel, extras=extras)
if args.seed_after_track:
    torch.manual_seed(job.rank)
prefetched = [torch.randn(32, 4) * 0.01] if args.prefetch else []  # a loader that draws ahead
if args.undeclared_group:
    dist.new_group([0, 1])
print("environment after track:", " ".join(f"{v}={os.environ.get(v, '-')}" for v in LAUNCH_VARIABLES), flush=True)
print(f"rank {job.rank} pid {os.getpid()}", flush=True)
ddp = model if args.fsdp else job.ddp(model)


replacement_busy = [int(v) for v in args.replacement_busy.split(":")] if args.replacement_busy else None


def hold_the_gil(seconds):
    """As a native call that never releases the GIL: no other thread (the heartbeat's) runs."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(seconds + 1)  # no other thread runs until this one blocks
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        pass
    sys.setswitchinterval(interval)
    print(f"rank {job.rank} held the GIL for {seconds}s", flush=True)


hold_gil_at = [float(v) for v in args.hold_gil_at.split(":")] if args.hold_gil_at else None


def train_step(step):
    if hold_gil_at and job.rank == hold_gil_at[0] and step == hold_gil_at[1] and \
            os.environ["PEERSTATE_ROLE"] == "worker":
        hold_the_gil(hold_gil_at[2])
    if replacement_busy and job.rank == replacement_busy[0] and os.environ["PEERSTATE_ROLE"] != "worker" and \
            not os.path.exists(f"{args.out}.replacement-busy"):
        open(f"{args.out}.replacement-busy", "w").close()  # its own replacement is not
        print(f"rank {job.rank}'s replacement busy for {replacement_busy[1]}s in step {step}", flush=True)
        time.sleep(replacement_busy[1])
    if job.rank == hold_rank and step == hold_step and job.recoveries == 0:
        print(f"rank {job.rank} holds at step {step}", flush=True)
        time.sleep(600)
    if job.rank == raise_rank and step == raise_step and (raise_always or os.environ["PEERSTATE_ROLE"] == "worker"):
        raise RuntimeError(f"rank {job.rank} was told to fail in step {step}")
    if job.rank == busy_rank and step == busy_step:
        print(f"rank {job.rank} busy for {busy_seconds}s in step {step}", flush=True)
        time.sleep(busy_seconds)
    if args.subgroups:
        subgroup_collectives(step)
    generator = torch.Generator().manual_seed(1000 * step + job.rank)
    x = torch.randn(32, 16, generator=generator)
    y = torch.randn(32, 4, generator=generator)
    noise = prefetched.pop() if prefetched else torch.randn(32, 4) * 0.01  # the global RNG: restored too
    loss = F.mse_loss(ddp(x) + noise, y)
    if not args.zero_grad_after_step:
        optimizer.zero_grad()
    loss.backward()
    time.sleep(args.step_seconds)
    optimizer.step()
    scheduler.step()
    if args.prefetch:
        prefetched.append(torch.randn(32, 4) * 0.01)
    if args.zero_grad_after_step:
        optimizer.zero_grad()
    if job.rank == late_rank and step == late_step and job.recoveries == 0:
        print(f"rank {job.rank} holds after step {step}", flush=True)
        time.sleep(600)


if args.hold_gil and job.rank == int(args.hold_gil.split(":")[0]) and job.recoveries == 0:
    hold_the_gil(float(args.hold_gil.split(":")[1]))

guarded_step = job.guarded(train_step)
for step in job.steps(args.steps):
    if args.step_function:  # the decorator: the loop body needs no `with`
        guarded_step(step)
    else:
        with job.guard():
            train_step(step)
    if args.pg_timeout and step == 1:
        # as a script written for the installed torch calls it: public from 2.14, which deprecates the private one
        set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
        set_timeout(datetime.timedelta(seconds=args.pg_timeout))
    if args.collective_outside_guard and step == 1:
        dist.all_reduce(torch.zeros(1))
    if args.draw_after_guard:
        torch.rand(1)
    if args.trace:
        digest = sum(float((p.to_local() if args.fsdp else p).double().sum()) for p in model.parameters())
        print(f"rank {job.rank} step {step} params {digest!r} lr {optimizer.param_groups[0]['lr']!r}", flush=True)
    else:
        print(f"rank {job.rank} step {step}", flush=True)

if args.out and args.fsdp:  # every rank its own shards
    shards = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    torch.save(shards, f"{args.out}.rank{job.rank}.tmp")
    os.replace(f"{args.out}.rank{job.rank}.tmp", f"{args.out}.rank{job.rank}")
elif args.out and job.rank == 0:
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.out + ".tmp")
    os.replace(args.out + ".tmp", args.out)
print(f"rank {job.rank} done at step {job.next_step}, {job.recoveries} recoveries", flush=True)
if args.sleep_after_loop_rank in (None, job.rank):
    time.sleep(args.sleep_after_loop)
if args.report_ports:
    host = os.environ["PEERSTATE_HOST"]
    print(f"rank {job.rank} listens on {len(listening_ports(host))} ports at {host}", flush=True)
job.close()
sys.exit(0)
