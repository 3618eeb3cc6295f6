"""Scale benchmark: a recovery's control plane and rendezvous at 256 to 16,384 ranks.

For each size N (nodes of 8 ranks, one spare each, the default data-parallel
layout: 8 shares, a buddy on the next node; one DDP wrapper), in the same run:

- ours: N/8 simulated nodes (``peerstate.tools.simulation``). Each runs the
  agent's own control code (``NodeControl``: its relay, instruction writer,
  coordinator, watch tick and lease checks) and its 8 workers' requests to the
  job's store with the worker's own code (``SimulatedMembers``: DDP layouts,
  replica sizes, recovery marks through the node channel), and each worker
  makes the requests torch's ProcessGroupNCCL makes to form the epoch's
  communicator (``NcclRendezvous``: the unique ids, through the store a worker
  hands torch, which reads them once per node, ``control.node_rendezvous``,
  with torch's TCPStore client). One real TCPStore; every node has its own
  connections; the nodes are multiplexed on threads in ``--processes`` processes, by default one per
  16 nodes, 4 to 32, plus one for the plan writer's node alone
  (``_writer_apart``). One rank is failed: its node's agent writes the plan,
  every node reports once, the plan writer writes one entry per node, every
  agent hands its members theirs, the members form the group, the
  replacement reads the DDP layout and its replica sizes, and every member's
  first step ends, which sends its marks to its agent. Measured: failure
  reported -> every worker holding its instructions (``instr_s``) and its
  group's unique ids (``ours_s``); the store requests and bytes of the whole
  recovery by client kind (agents, workers, rendezvous: every client counts
  its own); the store's busiest second (requests in any one-second window).
- baseline: the protocol before the node agents (the all-to-all of
  ``EpochJoiner`` up to commit be51987): every member waits for and reads a
  plan that lists all N members, publishes its report, waits for and reads all
  N reports, then forms the group as torch does by default (each rank reads
  the ids itself). Its N members run on threads over the same store.
- steady state: the store requests per second of leases and watchers, from
  real agent ticks (ours: ring window; baseline: every other node's lease,
  dead and done keys each tick, plus a worker's watcher wait each second). A
  worker makes no request to the job's store between recoveries (its watcher
  waits on the node channel).

Modelled, not measured: the node channel (in-process, instantaneous); a
node's 8 workers share one connection and take turns on a thread; the
workers' abort, restore and step (a step ends at once); NCCL's own
communicator initialisation (``tools/goodput``: modelled, with its sources);
gloo's rendezvous (every rank reads every other rank's address: O(N^2) by
design, for CPU jobs, not simulated here).

With ``--etcd``, ours also runs over a 1-member etcd on loopback (the same
simulated nodes, the store an ``EtcdKeyValueStore`` each): the ``etcd_s``
column, and its ratio to the TCPStore's in the same run.

Run: python bench/scale.py [--quick] [--sizes 256,1024] [--baseline-max 4096] [--etcd]
Writes bench/results/scale.json (scale_etcd.json with --etcd): rows with ranks,
ours_s, instructions_s, baseline_s, speedup, store_requests (and by kind),
store_bytes, busiest_second_requests, steady_requests_per_s (and the
baseline's; etcd_s and etcd_vs_tcpstore).
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "scale.json"
NPROC = 8
WATCH_SECONDS = 0.1   # launcher.agent.WATCH_SECONDS: one store tick per agent
RELAY_WAIT_SECONDS = 1.0  # NodeRelay's idle wait for the next plan
OLD_WATCHER_SECONDS = 1.0  # the old per-worker watcher's wait on the job's store
KINDS = ("agents", "workers", "rendezvous")  # the job store's clients, counted apart
SAMPLE_SECONDS = 0.25  # the busiest second's resolution; finer sampling cost a second of the agents' CPU
PACKED_SWITCH_INTERVAL = 0.05  # sys.setswitchinterval of a process of simulated agents (see run_agents)


def _store(address: str, host_store: bool = False):
    from peerstate.control.stores import open_store

    return open_store(address, timeout=300.0, host_store=host_store)


def _new_store(etcd) -> tuple:
    """(a client of a fresh store, its address): a TCPStore this process hosts, or a fresh
    job prefix on the etcd cluster ``etcd``."""
    if etcd is None:
        kv = _store("127.0.0.1:0", host_store=True)
        return kv, f"127.0.0.1:{kv.port}"
    from peerstate.control.etcd_store import EtcdKeyValueStore

    kv = EtcdKeyValueStore(etcd.endpoints, f"/peerstate/scale-{time.time_ns()}/", unavailable_timeout=120.0)
    return kv, kv.address


# -- a member process: simulated agents (ours) ---------------------------------------------------
def run_agents(args) -> None:
    from peerstate.control import keys
    from peerstate.tools.simulation import SimulatedNode, buddy_placement, served_by

    world = args.nnodes * NPROC
    placement = buddy_placement(world, NPROC, 1)
    served = served_by(world, NPROC, 1, placement)
    with ThreadPoolExecutor(64) as pool:  # a TCPStore client now and then takes seconds to connect: overlap them
        nodes = list(pool.map(lambda n: SimulatedNode(args.store, n, args.nnodes, NPROC, served, report_timeout=600.0,
                                                      placement=placement),
                              range(args.first, args.last)))
    for node in nodes:
        node.connect()
    kv = _store(args.store)
    # Every rank published its replica size at its first step (steady state, before the measured recovery).
    kv.set_many([(keys.replica_bytes(r), str(1 << 30).encode()) for r in range(args.first * NPROC, args.last * NPROC)])
    kv.add("sim/connected", 1)  # every node connected (a job's agents start together) before any relays
    while kv.add("sim/connected", 0) < args.processes:
        time.sleep(0.05)
    for node in nodes:
        node.start()
    for node in nodes:
        try:
            node.channel.wait_delivered(0, 300.0)
        except TimeoutError as error:
            raise RuntimeError(f"{error}; {_setup_state(kv, args.nnodes, nodes)}") from None
    members = [threading.Thread(target=node.members.run, args=(1, 100), daemon=True) for node in nodes]
    for thread in members:
        thread.start()
    before, before_at = _counts(nodes), time.time()
    # One process holds the long-lived objects of a hundred agents (connections, threads, relays), which
    # every cyclic collection the recovery's allocations trigger would scan again: an artefact of packing
    # agents into a process (an agent's own process holds one node's). Freeze them, as gc.freeze is for.
    gc.freeze()
    # Likewise the interpreter lock: a thread waiting for it wakes every switch interval (5 ms) and
    # makes the holder hand it over. An agent's process has a few threads; dozens of agents packed
    # in one have hundreds, and when a recovery wakes them all at once those timed waits
    # became a convoy: at 16,384 ranks nine runs took 4.5 to 111 s, the slow ones' relay threads
    # spending up to 68 CPU-seconds in the kernel re-taking the lock after their store calls (2026-12-07).
    # At 50 ms five runs took 5.6-8.4 s before the other fixes of that day, with no such outlier.
    sys.setswitchinterval(PACKED_SWITCH_INTERVAL)
    sampler = _Sampler(nodes)
    cpu_before = time.process_time()
    kv.add("sim/ready", 1)
    delivered = [node.channel.wait_delivered(1, 300.0) for node in nodes]
    for thread in members:
        thread.join(300.0)
    deadline = time.monotonic() + 120.0  # every agent forwarded its members' marks, the last assembled them
    while kv.get(keys.recovery_seconds(1)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    cpu = time.process_time() - cpu_before  # this process's relays and members (every thread) through the recovery
    samples = sampler.stop()
    ready = [node.members.ready.get(1) for node in nodes]
    if None in ready:
        raise RuntimeError(f"nodes {[n.node for n, r in zip(nodes, ready) if r is None][:10]} did not form epoch 1's "
                           "group")
    after = _counts(nodes)
    writers = [node.writer for node in nodes if node.writer.last_times.get("published", 0) > before_at]
    compute = writers[0].last_compute_s if writers else 0.0
    writer_times = writers[0].last_times if writers else {}
    for node in nodes:
        node.stop(wait=False)  # each relay leaves its wait within a second: all at once, not one after another
    for node in nodes:
        node.stop()
    ticks, start = 3, _counts(nodes)["agents"]
    for round_ in range(ticks):
        for node in nodes:
            node.tick(100.0 + round_ * WATCH_SECONDS)
    per_tick = (_counts(nodes)["agents"] - start) / (ticks * len(nodes))
    kv.set(f"sim/result/{args.index}", json.dumps({
        "last_delivery": max(delivered), "last_ready": max(ready),
        "requests": {kind: after[kind] - before[kind] for kind in KINDS},
        "bytes": {kind: after[kind + "_bytes"] - before[kind + "_bytes"] for kind in KINDS},
        "compute_s": compute, "writer_times": writer_times, "samples": samples,
        "first_delivery": min(delivered), "requests_per_tick": per_tick, "cpu_s": cpu,
        "failures": [f for node in nodes for f in node.failures]}).encode())


class _Sampler:
    """This process's store requests by client kind, summed every ``SAMPLE_SECONDS``
    (for the store's busiest second: the orchestrator adds every process's up)."""

    def __init__(self, nodes) -> None:
        self._nodes, self.samples, self._stop = nodes, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            counts = _counts(self._nodes)
            self.samples.append([time.time(), *(counts[kind] for kind in KINDS)])
            if self._stop.wait(SAMPLE_SECONDS):
                counts = _counts(self._nodes)
                self.samples.append([time.time(), *(counts[kind] for kind in KINDS)])
                return

    def stop(self) -> list:
        self._stop.set()
        self._thread.join()
        return self.samples


def _setup_state(kv, nnodes: int, nodes) -> str:
    """Why epoch 0 has not reached these nodes: what the relays said, which nodes of the
    job have not reported for epoch 0 (the writer waits for them) and where this process's
    relays stand."""
    from peerstate.control import keys

    missing = [n for n, raw in zip(range(nnodes), kv.get_many([keys.node_report(0, n) for n in range(nnodes)]))
               if raw is None]
    stuck = [(n.node, n.relay._mirrored, n.control.relaying) for n in nodes if n.node in missing]
    return (f"this process's relays said {[f for n in nodes for f in n.failures][:3]}; nodes {missing[:10]} of the "
            f"job have not reported for epoch 0; this process's among them (node, newest plan relayed, relay alive): "
            f"{stuck[:10]}")


def _counts(nodes) -> Dict[str, int]:
    """Requests and bytes of this process's clients of the job's store, by kind: the agents
    (a node's relay connection counts into its agent's), the workers, the rendezvous."""
    clients = {"agents": [n.kv.count for n in nodes], "workers": [n.members.kv.count for n in nodes],
               "rendezvous": [n.members.rendezvous.count for n in nodes]}
    counts: Dict[str, int] = {}
    for kind, each in clients.items():
        counts[kind] = sum(c.requests for c in each)
        counts[kind + "_bytes"] = sum(c.bytes_sent + c.bytes_received for c in each)
    return counts


# -- a member process: the old all-to-all protocol (baseline) -------------------------------------
def run_old_members(args) -> None:
    from peerstate.control.node_rendezvous import node_rendezvous_store
    from peerstate.tools.simulation import NcclRendezvous, SimulatedChannel, served_by

    world = args.nnodes * NPROC
    served = served_by(world, NPROC, 1)
    ranks = list(range(args.first, args.last))
    threads = 16
    with ThreadPoolExecutor(threads) as pool:
        stores = list(pool.map(lambda _: _store(args.store), range(threads)))
    # torch's default: each rank reads the job's store itself (no node channel to share reads through)
    rendezvous = [NcclRendezvous(node_rendezvous_store(kv.rendezvous_store(), None, 300.0)) for kv in stores]
    reports = {r: SimulatedChannel(r // NPROC, NPROC, served, 100).report(r, f"n{r // NPROC}.{r % NPROC}").encode()
               for r in ranks}
    names = [f"epoch/1/report/{r}" for r in range(world)]
    done: List[float] = []
    lock = threading.Lock()
    stores[0].add("sim/ready", 1)

    def member_thread(index: int) -> None:
        kv = stores[index]
        mine = ranks[index::threads]
        for rank in mine:  # the watcher sees the plan; the member publishes its report
            kv.wait(["epoch/1/plan"], timeout=300.0)
            kv.get_many(["epoch/1/plan"])
            kv.set(f"epoch/1/report/{rank}", reports[rank])
        for rank in mine:  # then waits for and reads every member's report
            kv.wait(names, timeout=300.0)
            kv.get_many(names)
        for rank in mine:  # and forms the epoch's group, as ours does
            rendezvous[index].announce(1, rank, world)
        for rank in mine:
            rendezvous[index].join(1, rank, world)
        with lock:
            done.append(time.time())

    workers = [threading.Thread(target=member_thread, args=(i,)) for i in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    counts = [s.count for s in stores] + [r.count for r in rendezvous]
    total = {"requests": sum(c.requests for c in counts), "bytes": sum(c.bytes_sent + c.bytes_received for c in counts)}
    stores[0].set(f"sim/result/{args.index}", json.dumps({"last_delivery": max(done), **total}).encode())


# -- the orchestrator ------------------------------------------------------------------------------
def _writer_apart(bounds: List[int], writer: int) -> List[int]:
    """``bounds`` with node ``writer`` (the plan writer's: the failed rank's) in a process
    of its own. On a job every agent has its own process; packed with a hundred
    others, the writer's gather, computation and write waited for their interpreter
    lock while all of them relayed the plan at once (its start came 0.1-1.0 s after
    the plan), an artefact of the packing that made the 16,384-rank figure vary by
    0.7 s from run to run. The other agents stay packed: they are the load."""
    return sorted(set(bounds) | {writer, writer + 1})


def _spawn(mode: str, store: str, nnodes: int, bounds: List[int]) -> List[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, __file__, "--member", mode, "--store", store, "--nnodes", str(nnodes),
                              "--first", str(a), "--last", str(b), "--index", str(i),
                              "--processes", str(len(bounds) - 1)])
            for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]


def _collect(kv, processes: List[subprocess.Popen], timeout: float) -> List[dict]:
    names = [f"sim/result/{i}" for i in range(len(processes))]
    deadline = time.monotonic() + timeout
    while True:
        try:
            kv.wait(names, timeout=1.0)
            break
        except TimeoutError:
            failed = [p.returncode for p in processes if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for p in processes:
                    p.kill()
                raise RuntimeError(f"simulated members failed ({failed}) or timed out")
    for p in processes:
        p.wait(timeout=60)
    return [json.loads(raw) for raw in kv.get_many(names)]


def _wait_ready(kv, count: int, processes: List[subprocess.Popen], timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while kv.add("sim/ready", 0) < count:
        if any(p.poll() not in (None, 0) for p in processes) or time.monotonic() > deadline:
            for p in processes:  # every thread's stack to stderr (faulthandler, registered in main), then stop
                if p.poll() is None:
                    p.send_signal(signal.SIGUSR1)
            time.sleep(2.0)
            for p in processes:
                p.kill()
            raise RuntimeError("simulated members did not start (their threads' stacks are above)")
        time.sleep(0.05)


def measure_ours(nnodes: int, processes: int, etcd=None) -> dict:
    from peerstate.control.coordinator import Coordinator

    kv, address = _new_store(etcd)
    victim = nnodes // 2
    bounds = _writer_apart([nnodes * i // processes for i in range(processes + 1)], victim)
    members = _spawn("agents", address, nnodes, bounds)
    _wait_ready(kv, len(members), members)
    reporter = Coordinator(_store(address))  # the victim node's agent, which reaped the worker
    before = reporter.kv.count.requests, reporter.kv.count.bytes_sent + reporter.kv.count.bytes_received
    failed_at, store_cpu = time.time(), time.process_time()  # this process hosts the store
    reporter.report_failure([f"n{victim}.0"], "simulated kill", detected_at=failed_at, me=f"agent{victim}")
    reporter_done = time.time()
    results = _collect(kv, members, 600.0)
    store_cpu = time.process_time() - store_cpu
    problems = [f for r in results for f in r["failures"]]
    if problems:
        raise RuntimeError(f"the simulated recovery failed: {problems[:3]}")
    requests = {kind: sum(r["requests"][kind] for r in results) for kind in KINDS}
    requests["agents"] += reporter.kv.count.requests - before[0]
    store_bytes = {kind: sum(r["bytes"][kind] for r in results) for kind in KINDS}
    store_bytes["agents"] += reporter.kv.count.bytes_sent + reporter.kv.count.bytes_received - before[1]
    per_tick = sum(r["requests_per_tick"] for r in results) / len(results)
    times = next(r["writer_times"] for r in results if r["writer_times"])
    phases = {"plan written": reporter_done - failed_at,
              **{f"writer {k}": v - failed_at for k, v in times.items()},
              "first node holds its instructions": min(r["first_delivery"] for r in results) - failed_at,
              "every node holds its instructions": max(r["last_delivery"] for r in results) - failed_at}
    agents_cpu = sum(r["cpu_s"] for r in results)
    print("   " + ", ".join(f"{k} {v:.3f}s" for k, v in phases.items()) +
          f"; CPU: agents and workers {agents_cpu:.2f}s, store {store_cpu:.2f}s", flush=True)
    return {"seconds": max(r["last_ready"] for r in results) - failed_at, "requests": requests,
            "agents_cpu_s": agents_cpu, "store_cpu_s": store_cpu, "busiest_second": _busiest_second(results),
            "bytes": store_bytes, "compute_s": max(r["compute_s"] for r in results), "phases": phases,
            "steady_per_node_s": per_tick / WATCH_SECONDS + 1 / RELAY_WAIT_SECONDS}


def _busiest_second(results: List[dict]) -> Dict[str, int]:
    """The store's busiest second of the recovery: the most requests (of every process's
    clients, by kind) in any one-second window, from each process's samples."""
    series = [r["samples"] for r in results]
    grid = sorted({round(t / SAMPLE_SECONDS) for s in series for t, *_ in s})

    def total_at(step: int) -> List[int]:  # every process's counts at the last sample up to this step
        sums = [0] * len(KINDS)
        for samples in series:
            last = next((row for row in reversed(samples) if round(row[0] / SAMPLE_SECONDS) <= step), samples[0])
            sums = [a + b for a, b in zip(sums, last[1:])]
        return sums

    totals = {step: total_at(step) for step in grid}
    window = round(1.0 / SAMPLE_SECONDS)
    best = [0] * len(KINDS)
    for step in grid:
        end = totals[max(s for s in grid if s <= step + window)]
        counts = [b - a for a, b in zip(totals[step], end)]
        if sum(counts) > sum(best):
            best = counts
    return dict(zip(KINDS, best))


def measure_baseline(nnodes: int, processes: int) -> dict:
    kv = _store("127.0.0.1:0", host_store=True)
    address = f"127.0.0.1:{kv.port}"
    world = nnodes * NPROC
    bounds = [world * i // processes for i in range(processes + 1)]
    members = _spawn("old", address, nnodes, bounds)
    _wait_ready(kv, processes, members)
    plan = json.dumps({"epoch": 1, "members": {r: f"n{r // NPROC}.{r % NPROC}" for r in range(world)},
                       "replaced": {nnodes // 2 * NPROC: f"n{nnodes // 2}.{NPROC}"},
                       "failed": [nnodes // 2 * NPROC], "reason": "simulated kill", "detected_at": 0.0,
                       "planned_at": 0.0}).encode()
    failed_at = time.time()
    kv.set("epoch/1/plan", plan)
    results = _collect(kv, members, 3600.0)
    # Steady state: one old lease check (every other node's lease, dead and done) by one agent, and its other
    # calls of a tick, on the real store; every agent makes the same.
    before = kv.count.requests
    others = [n for n in range(nnodes) if n != 0]
    kv.add("node/0/lease", 1)
    kv.get("job/failed")
    kv.add("job/finished", 0)
    kv.get_many([f"node/{n}/{what}" for n in others for what in ("lease", "dead", "done")])
    per_tick = kv.count.requests - before
    return {"seconds": max(r["last_delivery"] for r in results) - failed_at,
            "requests": sum(r["requests"] for r in results) + 1,
            "bytes": sum(r["bytes"] for r in results) + len(plan),
            "steady_per_node_s": per_tick / WATCH_SECONDS + NPROC / OLD_WATCHER_SECONDS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="sizes up to 4,096 ranks, the baseline up to 1,024")
    parser.add_argument("--sizes", default=None, help="comma-separated rank counts (multiples of 8)")
    parser.add_argument("--baseline-max", type=int, default=None, help="largest size the baseline runs at")
    parser.add_argument("--processes", type=int, default=0,
                        help="processes the simulated agents share (default: one per 16 nodes, 4 to 32)")
    parser.add_argument("--etcd", action="store_true",
                        help="also run ours over a 1-member etcd on loopback (needs the etcd binary): the etcd_s "
                             "column, in the same run; writes scale_etcd.json")
    parser.add_argument("--member", choices=("agents", "old"), help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--nnodes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--last", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.member:
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # the orchestrator's view into a stuck setup
    if args.member == "agents":
        return run_agents(args)
    if args.member == "old":
        return run_old_members(args)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else (
        [256, 1024, 4096] if args.quick else [256, 1024, 4096, 16384])
    baseline_max = args.baseline_max or (1024 if args.quick else 4096)
    etcd = None
    if args.etcd:
        import tempfile

        from peerstate.tools.etcd_cluster import EtcdCluster

        etcd = EtcdCluster(Path(tempfile.mkdtemp(prefix="peerstate-scale-etcd-")))
    try:
        _measure(args, sizes, baseline_max, etcd)
    finally:
        if etcd:
            etcd.close()


def _measure(args, sizes: List[int], baseline_max: int, etcd) -> None:
    rows = []
    print(f"{'ranks':>6} {'nodes':>5} {'ours_s':>7} {'instr_s':>7} {'base_s':>7} {'speedup':>7} {'req/rank':>8} "
          f"{'agents':>6} {'workers':>7} {'rdzv':>5} {'store_MB':>8} {'busiest/s':>9} {'base_req/rank':>13} "
          f"{'steady/node/s':>13} {'base_steady/node/s':>18}", flush=True)
    for ranks in sizes:
        nnodes = ranks // NPROC
        # One process per 16 simulated nodes, 4 to 32: a process packs its agents' threads under one
        # interpreter lock, whose hand-offs cost the kernel more than the protocol costs Python (an agent
        # has a process of its own). At 16,384 ranks 16 processes took 10-15 s, 32 took 5-7 s, 48 no
        # less; at 1,024 ranks 2 processes gave 14.5-18.8x the baseline, 4 gave 20.1-25.0x, 8 26x.
        processes = args.processes or min(32, max(4, nnodes // 16))
        ours = measure_ours(nnodes, processes)
        over_etcd = measure_ours(nnodes, processes, etcd) if etcd else None
        base = measure_baseline(nnodes, processes) if ranks <= baseline_max else None
        total = sum(ours["requests"].values())
        row = {"ranks": ranks, "nodes": nnodes, "ours_s": round(ours["seconds"], 4),
               "instructions_s": round(ours["phases"]["every node holds its instructions"], 4),
               "plan_compute_s": round(ours["compute_s"], 4),
               "agents_cpu_s": round(ours["agents_cpu_s"], 3), "store_cpu_s": round(ours["store_cpu_s"], 3),
               "phases_s": {k: round(v, 4) for k, v in ours["phases"].items()},
               "baseline_s": round(base["seconds"], 4) if base else None,
               "speedup": round(base["seconds"] / ours["seconds"], 1) if base else None,
               "store_requests": total, "store_requests_per_rank": round(total / ranks, 2),
               "store_requests_by_kind": ours["requests"],
               "store_requests_per_rank_by_kind": {k: round(v / ranks, 2) for k, v in ours["requests"].items()},
               "store_bytes": sum(ours["bytes"].values()), "store_bytes_by_kind": ours["bytes"],
               "busiest_second_requests": ours["busiest_second"],
               "baseline_store_requests": base["requests"] if base else None,
               "baseline_store_bytes": base["bytes"] if base else None,
               "steady_requests_per_s": round(ours["steady_per_node_s"] * nnodes, 1),
               "steady_requests_per_node_s": round(ours["steady_per_node_s"], 2),
               "baseline_steady_requests_per_s": round(_baseline_steady(base, nnodes), 1) if base else None,
               "baseline_steady_requests_per_node_s": round(base["steady_per_node_s"], 2) if base else None}
        row["processes"] = processes
        if over_etcd:
            row.update(etcd_s=round(over_etcd["seconds"], 4), etcd_vs_tcpstore=round(over_etcd["seconds"] /
                                                                                    ours["seconds"], 2),
                       etcd_store_requests_per_rank=round(sum(over_etcd["requests"].values()) / ranks, 2),
                       etcd_phases_s={k: round(v, 4) for k, v in over_etcd["phases"].items()})
            print(f"   over etcd: {over_etcd['seconds']:.3f}s ({row['etcd_vs_tcpstore']}x the TCPStore's), "
                  f"{row['etcd_store_requests_per_rank']} requests per rank", flush=True)
        rows.append(row)
        _save(rows, args)
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        by_kind = row["store_requests_per_rank_by_kind"]
        print(f"{ranks:>6} {nnodes:>5} {row['ours_s']:>7.3f} {row['instructions_s']:>7.3f} "
              f"{fmt(row['baseline_s'], '>7.3f')} {fmt(row['speedup'], '>7.1f')} "
              f"{row['store_requests_per_rank']:>8.2f} "
              f"{by_kind['agents']:>6.2f} {by_kind['workers']:>7.2f} {by_kind['rendezvous']:>5.2f} "
              f"{row['store_bytes'] / 1e6:>8.2f} {sum(ours['busiest_second'].values()):>9} "
              f"{fmt(base and base['requests'] / ranks, '>13.1f')} {row['steady_requests_per_node_s']:>13.1f} "
              f"{fmt(row['baseline_steady_requests_per_node_s'], '>18.1f')}", flush=True)
    print(f"wrote {RESULTS.with_name('scale_etcd.json') if args.etcd else RESULTS}")


def _save(rows: List[dict], args) -> None:
    """Write the rows measured so far, kept beside those of other sizes from earlier runs
    (each row names the command that measured it)."""
    command = " ".join(["python", "bench/scale.py", *sys.argv[1:]])
    results = RESULTS.with_name("scale_etcd.json") if args.etcd else RESULTS
    kept = []
    if results.exists():
        kept = [r for r in json.loads(results.read_text())["rows"] if r["ranks"] not in {n["ranks"] for n in rows}]
    for row in rows:
        row.setdefault("command", command)
    results.parent.mkdir(exist_ok=True)
    results.write_text(json.dumps({"ranks_per_node": NPROC, "rows": sorted(kept + rows, key=lambda r: r["ranks"])},
                                  indent=1))


def _baseline_steady(base: dict, nnodes: int) -> float:
    return base["steady_per_node_s"] * nnodes


if __name__ == "__main__":
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    main()
