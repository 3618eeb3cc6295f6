"""The node agent behind ``peerstate run``: one per node.

It starts this node's workers and hot spares (forked from its fork server,
``launcher.fork_server``, unless ``--preload ''``), sees a worker die at once
(every few milliseconds: ``waitpid``, and before that the kernel's own mark of
a process that has begun to exit, see ``ExitWatch``), sees a worker freeze
through its progress counter in shared memory (and keeps a hung one stopped
for its replacement to read, ``stopped_workers``), keeps this node's heartbeat
lease alive and watches the next nodes' on a ring (``leases``), writes
recovery plans (through the Coordinator) when it sees a failure, relays the
recovery protocol between its workers and the job's store through a node
channel it hosts on loopback (``NodeRelay``; as an epoch's owner it writes
every node's instructions), refills its spare pool, lands the faults of
``--inject`` (``fault_delivery``), and never restarts a healthy worker. It
exits 0 when every rank finished, and otherwise non-zero with a one-paragraph
summary.

Worker names are ``n{node}.{k}``: the first ``nproc_per_node`` are the initial
workers (rank = node * nproc_per_node + k), the rest are spares.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from peerstate.control import keys
from peerstate.control import progress as progress_file
from peerstate.control.environment import SCRIPT_DEFAULT_GROUP, STACKS_SIGNAL, WorkerEnvironment, job_secret
from peerstate.control.findings import FindingsReader
from peerstate.control.kvstore import TorchKeyValueStore, store_gone
from peerstate.control.memory_figures import MEMORY_EVENT, describe_memory, latest_per_rank
from peerstate.control.node_control import NodeControl
from peerstate.control.planning import node_of_worker
from peerstate.control.progress import ProgressCounter
from peerstate.control.timeline import EventLog, read_events
from peerstate.errors import InvalidArgumentError, JobFailedError, StoreUnavailableError
from peerstate.launcher.inject import FaultInjector
from peerstate.launcher.config import AgentConfig
from peerstate.launcher.fault_delivery import FaultDelivery
from peerstate.launcher.fork_server import ForkServer
from peerstate.launcher.fork_server_process import own_interpreter_command
from peerstate.launcher.processes import (WorkerProcess, describe_exit, die_with_parent, log_tail,
                                          remove_stale_counters)
from peerstate.launcher.stopped_workers import StoppedWorkers
from peerstate.launcher.store_connection import open_job_store
from peerstate.replication.worker_keys import WorkerKeys

POLL_SECONDS = 0.005
WATCH_SECONDS = 0.1
STACKS_GRACE = 0.2  # seconds a hung worker is given to print its stacks (Agent._ask_for_stacks)
SPARE_START_ATTEMPTS = 3  # spares in a row whose script fails before they are ready: then the job stops


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        config.validate()
        self.config = config
        # A missing or bad secret fails here, before anything starts.
        self.keys = WorkerKeys(job_secret(config.nnodes, config.secret_file))
        self.node = config.node_rank
        self.world_size = config.nnodes * config.nproc_per_node
        self.name = f"agent{self.node}"
        self.log_dir = Path(config.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.events = EventLog(str(self.log_dir / "events.jsonl"), self.name)
        self.processes: Dict[str, WorkerProcess] = {}
        self._next_index = config.nproc_per_node
        self._progress_dir = Path("/dev/shm" if os.path.isdir("/dev/shm") else self.log_dir)
        remove_stale_counters(self._progress_dir)
        self._stopping = False
        # A bad --inject spec fails here, before anything starts.
        self.injector = FaultInjector(config.inject, world_size=self.world_size, nnodes=config.nnodes,
                                      node=self.node)
        self._spares_wanted = 0
        self._spare_start_failures = 0  # spares in a row whose script failed before they were ready
        self._dying: list = []  # failed workers (Popen, ForkedProcess) whose exit has not completed yet
        self._fenced_reason: Optional[str] = None
        self._forks: Optional[ForkServer] = None  # see launcher.fork_server (None until the first worker)

    # -- start ----------------------------------------------------------------------
    def run(self) -> int:
        try:
            if self.config.preload:
                # Its imports overlap the nodes' join. Forked from here, before any thread:
                # torch, which the agent's stores need too, is imported once for both.
                self._fork_server(share=["torch.distributed"])
            self._connect()
            self._spawn_initial()
            return self._watch()
        except StoreUnavailableError as error:
            return self._lost_store(str(error))
        except JobFailedError as error:
            return self._stop(str(error))
        except InvalidArgumentError as error:  # found only on reaching the store (a refused certificate)
            print(f"peerstate run: {error}", file=sys.stderr, flush=True)
            return 2
        except Exception as error:  # noqa: BLE001 - a TCPStore gone, or a bug of ours: said as what it is
            if not hasattr(self, "kv"):
                raise
            if store_gone(error):
                return self._lost_store(f"node {self.node} lost {self.kv.describe()}, hosted by node 0's agent: "
                                        f"{error}")
            self.events.write("agent_failed", node=self.node, error=traceback.format_exc())
            print(f"peerstate: node {self.node}'s agent failed (a bug in peerstate; please report it with this "
                  f"traceback); its workers and spares stop with it, and the other nodes treat the node as "
                  f"lost:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            return 1
        finally:
            self._kill_all()

    def _connect(self) -> None:
        config = self.config
        self.kv, self.hosts_store = open_job_store(config.store, self.node, config.job_id, config.store_timeout,
                                                   config.join_timeout, config.store_tls)
        self.store_address = self.kv.address
        if self.hosts_store:
            print(f"peerstate: store at {self.store_address}", file=sys.stderr, flush=True)
        self.control = NodeControl(self.kv, self.node, config.nnodes, config.nproc_per_node,
                                   join_timeout=config.join_timeout, lease_timeout=config.lease_timeout,
                                   spare_timeout=config.spare_timeout, events=self.events, on_fenced=self._fenced)
        self.coordinator = self.control.coordinator
        self.control.connect()
        self._start_relay()
        self.stopped = StoppedWorkers(self.channel, self.events)
        self.findings = FindingsReader(self.channel)
        self.faults = FaultDelivery(self.injector, self.kv, self.name, self.events)
        self.events.write("agent_started", node=self.node, store=self.store_address)

    def _start_relay(self) -> None:
        """Host this node's channel (loopback, for its own workers only) and relay the
        recovery protocol between it and the job's store (``NodeRelay``)."""
        self.channel = TorchKeyValueStore("127.0.0.1", 0, host_store=True, timeout=self.config.join_timeout)
        self.control.start_relay(self.channel.clone(), certify=self.keys.certify)

    def _fenced(self) -> None:
        """This node was declared lost while it lives (a lease or a report came too
        late): its ranks belong to spares now, so its workers must stop."""
        self._fenced_reason = (f"node {self.node} was declared lost by the other nodes (its lease or its report came "
                               "too late); its ranks were given to spares")

    def _spawn_initial(self) -> None:
        for local in range(self.config.nproc_per_node):
            self._spawn(f"n{self.node}.{local}", self.node * self.config.nproc_per_node + local)
        for _ in range(self.config.spares):
            self._spawn_spare()

    def _spawn_spare(self) -> None:
        worker = f"n{self.node}.{self._next_index}"
        self._next_index += 1
        self._spawn(worker, None)
        self.events.write("spare_started", worker=worker)

    def _spawn(self, worker: str, rank: Optional[int]) -> None:
        config = self.config
        counter_path = self._progress_dir / f"peerstate-{os.getpid()}-{worker}.progress"
        progress_file.create(str(counter_path))
        env = self.config.workers_environment(os.environ)
        private_key, certificate = self.keys.new_worker(worker, rank)
        env.update(WorkerEnvironment(
            store=self.store_address, worker=worker, spare=rank is None, world_size=self.world_size,
            nproc_per_node=config.nproc_per_node, node=self.node, host=config.host, progress=str(counter_path),
            events=str(self.log_dir / "events.jsonl"), private_key=private_key,
            job_key=self.keys.job_key, certificate=certificate, rank=rank,
            checkpoint_dir=config.checkpoint_dir, checkpoint_every=config.checkpoint_every,
            protection=config.frame_protection, node_store=f"127.0.0.1:{self.channel.port}").to_env())
        log = self.log_dir / f"{worker}.log"
        if config.preload:
            popen = self._fork_server().spawn(config.script, env, str(log))
        else:
            with open(log, "ab") as out:
                popen = subprocess.Popen(own_interpreter_command(config.script), env=env, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=die_with_parent)
        self.processes[worker] = WorkerProcess(worker, rank, popen, ProgressCounter(str(counter_path)), log)

    def _fork_server(self, share: Sequence[str] = ()) -> ForkServer:
        """This node's fork server, started on first use (again if it died: what it had
        started died with it and is reported as killed); ``share``: see ``ForkServer``."""
        if self._forks is None or not self._forks.alive():
            if self._forks is not None:
                self._forks.close()
            # A server forked from the agent shows the agent's environment in /proc (LocalJob
            # marks the agents' with the job's event log too).
            self._forks = ForkServer(self.config.preload, self.config.fork_server_environment(os.environ),
                                     str(self.log_dir / f"fork-server-{self.node}.log"), share)
        return self._forks

    # -- watch ----------------------------------------------------------------------
    def _watch(self) -> int:
        next_watch = 0.0
        while True:
            failed: List[Tuple[str, str, float]] = []
            for process in list(self.processes.values()):
                code = process.popen.poll()
                if code is None:
                    code = process.exit_watch.status()
                    if code is not None:
                        self._dying.append(process.popen)  # reaped once its exit completes
                if code is not None:
                    failed.extend(self._exited(process, code))
            if failed:  # ranks lost in one pass are planned for together: one recovery, not one each
                self.control.report([w for w, _, _ in failed], "; ".join(r for _, r, _ in failed),
                                    min(t for _, _, t in failed))
            self._dying = [popen for popen in self._dying if popen.poll() is None]
            self.faults.deliver(self.processes)
            now = time.monotonic()
            if now >= next_watch:
                next_watch = now + WATCH_SECONDS
                if self._fenced_reason:
                    self._stopping = True
                    print(f"peerstate: {self._fenced_reason}. Node {self.node} stops its workers and spares.",
                          file=sys.stderr, flush=True)
                    return 1
                tick = self.control.tick([p.worker for p in self.processes.values() if p.rank is None])
                if tick.failure:
                    self.channel.set(keys.JOB_FAILED, tick.failure.encode())  # its workers look for it there
                    return self._stop(tick.failure)
                self.findings.say_new(self.events, self._fail if self.config.strict else None)
                if tick.finished >= self.world_size and not self._live_workers():
                    self.kv.set(keys.node_done(self.node), b"1")
                    self.events.write("agent_done", node=self.node)
                    self._say_memory()
                    self.findings.say_all(f"node {self.node}'s ranks finished")
                    if self.hosts_store:
                        self._outlive_other_nodes()
                    return 0
                self._follow_spares(tick.spare_states)
                self._check_hangs(time.monotonic())  # fresh: a stale now reads a live worker as hung
                self.control.check_leases(time.monotonic())  # not ``now``: the calls above may have waited
                self._refill()
            time.sleep(POLL_SECONDS)

    def _say_memory(self) -> None:
        """The run's summary: the host memory this node's ranks held for recoveries (the
        log may be shared with other nodes' agents: only this node's workers count)."""
        path = self.log_dir / "events.jsonl"
        memory = latest_per_rank(e for e in (read_events(str(path)) if path.exists() else [])
                                 if e.get("event") == MEMORY_EVENT and str(e.get("source")).startswith("n")
                                 and node_of_worker(e["source"]) == self.node)
        if memory:
            print(f"peerstate: node {self.node}: {describe_memory(memory)}", file=sys.stderr, flush=True)

    def _outlive_other_nodes(self) -> None:
        """Node 0 hosts the store, so it stays until every other node is done or declared
        lost: a live agent must not lose the store mid-read because its workers take
        long to exit (a script saving its model after the loop, a close() on a loaded
        machine). No fixed bound: while it waits it keeps its lease and its lease watch,
        so a node that stops answering is declared lost within the lease timeout (its
        report finds every rank finished and plans nothing), and a live one is waited
        for as its own agent waits for its workers."""
        others = range(1, self.config.nnodes)
        while True:
            flags = self.kv.get_many([keys.node_done(n) for n in others] + [keys.node_dead(n) for n in others])
            if all(flags[i] or flags[len(others) + i] for i in range(len(others))):
                return
            self.control.tick()
            self.control.check_leases(time.monotonic())
            time.sleep(WATCH_SECONDS)

    def _live_workers(self) -> List[WorkerProcess]:
        return [p for p in self.processes.values() if p.rank is not None and p.popen.poll() is None]

    def _exited(self, process: WorkerProcess, code: int) -> List[Tuple[str, str, float]]:
        """Handle a child's exit; returns the failure to report, [(worker, reason, detected
        at)], or [] where there is none (a waiting spare, a finished rank, a stopping job)."""
        detected_at = time.time()
        del self.processes[process.worker]
        heartbeat, step, _ = process.counter.read()
        finished = step == progress_file.FINISHED  # it had left its steps() loop
        reached_job = heartbeat > 0  # read now: the watch may not have looked since its first heartbeat
        process.counter.close()
        process.exit_watch.close()
        os.unlink(process.counter.path)
        how = process.describe_hang() if process.hung else describe_exit(code)
        self.events.write("process_exited", worker=process.worker, rank=process.rank, code=code, how=how)
        if self.stopped.forget(process) or self._stopping or (code == 0 and process.rank is not None) or \
                self.coordinator.failure():
            return []  # reported when it was frozen; or it stops because the job failed: not a new failure
        if finished and process.rank is not None:
            # Its state is final and counted; the others never wait on it again. Only what its
            # script does after the loop (saving, evaluating) did not run: said, not recovered.
            print(f"peerstate: rank {process.rank} ({process.worker}) {how} after its last step, in close() or "
                  "later: not recovered (its training is complete), but what its script does after the loop may "
                  f"not have run. Last lines of {process.log}:\n{log_tail(process.log)}", file=sys.stderr, flush=True)
            self.events.write("exited_after_last_step", worker=process.worker, rank=process.rank, code=code)
            return []
        ready = True
        if process.rank is None:
            ready = self.kv.get(keys.spare_state(process.worker)) is not None  # it reached track()'s wait
            assigned = self.coordinator.spare_gone(process.worker) if ready else None
            if assigned is not None:
                process.rank = assigned[1]  # its death is that rank's failure
        who = f"hot spare {process.worker}" if process.rank is None else f"rank {process.rank} ({process.worker})"
        if code > 0 and not reached_job:
            tail = log_tail(process.log)
            hint = f"\nIt failed in init_process_group(): {SCRIPT_DEFAULT_GROUP}" if "init_process_group" in tail \
                else ""
            self._fail(f"{who} {how} before it reached peerstate.Job(), in {' '.join(self.config.script)}: the "
                       f"script fails at start-up. Last lines of {process.log}:\n{tail}{hint}")
            return []
        if process.rank is None:
            if code > 0 and not ready:
                self._spare_failed_to_start(process, how)
            return []  # a waiting spare died: the pool is refilled
        return [(process.worker, f"rank {process.rank} ({process.worker}) {how}", detected_at)]

    def _spare_failed_to_start(self, process: WorkerProcess, how: str) -> None:
        """A spare whose script failed between Job() and track()'s wait: said at once,
        and after SPARE_START_ATTEMPTS in a row the job stops (respawning it would only
        hide that no spare can ever take a rank)."""
        self._spare_start_failures += 1
        message = (f"hot spare {process.worker} {how} after peerstate.Job() and before it was ready to take a "
                   f"rank (start failure {self._spare_start_failures} of {SPARE_START_ATTEMPTS} in a row on node "
                   f"{self.node}). Last lines of {process.log}:\n{log_tail(process.log)}")
        if self._spare_start_failures < SPARE_START_ATTEMPTS:
            print(f"peerstate: {message}", file=sys.stderr, flush=True)
            return
        self._fail(f"{message}\nThe script fails on every hot spare before track() returns. A spare has no RANK "
                   "until track() gives it one, and its LOCAL_RANK is provisional (docs/training-script.md, 'What a "
                   "training script must and must not do'): code before track() must not depend on the rank.")

    def _follow_spares(self, states: Dict[str, Optional[bytes]]) -> None:
        """Learn which of this node's spares a planner claimed (they no longer count as
        waiting) and which became workers (then they are watched for hangs): the ones
        the latest plan names (each spare reads its rank in the plans themselves)."""
        waiting = {p.worker: p for p in self.processes.values() if p.rank is None and p.worker in states}
        for worker, process in waiting.items():
            state = states[worker]
            process.claimed = bool(state and state.startswith(b"assigned:"))
            process.ready = state == b"ready"
            if state:
                self._spare_start_failures = 0  # a spare of this script can get ready: the earlier ones were bad luck
        claimed = [w for w, p in waiting.items() if p.claimed]
        if claimed:
            for worker, rank in self.coordinator.assignments(claimed).items():
                waiting[worker].rank = rank

    def _check_hangs(self, now: float) -> None:
        for process in self.processes.values():
            cause = process.read_progress(now, self.config.hang_timeout, self.config.join_timeout,
                                          self.config.freeze_timeout)
            if cause and process.rank is not None and not process.hung:
                process.hung = cause
                if cause == "stalled":  # it runs: its stacks say where (a frozen one answers no signal)
                    self._ask_for_stacks(process)
                if self.stopped.freeze(process):  # reported now, killed once its replacement read it
                    self.control.report([process.worker],
                                 f"rank {process.rank} ({process.worker}) {process.describe_hang(held=True)}",
                                 time.time())
                    continue
                process.signal_group(signal.SIGKILL)  # reaped, and reported, by the next poll
        self.stopped.kill_released(now)

    def _ask_for_stacks(self, process: WorkerProcess) -> None:
        """Have a hung worker print every thread's stack to its log before it is frozen
        or killed (``STACKS_SIGNAL``; it registered the dump before its first heartbeat).
        Waits ``STACKS_GRACE`` for it: best effort on a busy node."""
        try:
            os.kill(process.popen.pid, STACKS_SIGNAL)
        except OSError:
            return
        time.sleep(STACKS_GRACE)

    def _refill(self) -> None:
        """Keep --spares spares waiting, but not while a recovery runs (a starting
        Python process takes a CPU-second or two from it) unless a planner is
        waiting for a spare."""
        waiting = sum(1 for p in self.processes.values() if p.rank is None and not p.claimed)
        if waiting >= self.config.spares:
            return
        wanted = self.kv.add(keys.SPARES_WANTED, 0)
        plan = self.coordinator.latest_plan()
        recovering = (plan.epoch > 0 and time.time() - plan.planned_at < self.config.spare_timeout
                      and self.kv.add(keys.marks_done(plan.epoch), 0) < self.world_size)
        if recovering and wanted == self._spares_wanted:
            return
        self._spares_wanted = wanted
        for _ in range(self.config.spares - waiting):
            self._spawn_spare()

    # -- stop -----------------------------------------------------------------------
    def _fail(self, message: str) -> None:
        self.coordinator.fail_job(message)

    def _stop(self, reason: str) -> int:
        self._stopping = True
        self.events.write("job_failed", node=self.node, reason=reason)
        finished = self.kv.add(keys.JOB_FINISHED, 0) if hasattr(self, "kv") else 0
        plan = None
        try:
            plan = self.coordinator.latest_plan()
        except Exception:  # noqa: BLE001 - no plan yet: the job failed while starting
            pass
        recovered = f"after {plan.epoch} recoveries, " if plan else ""
        print(f"peerstate: the job cannot go on: {reason.rstrip('.')}. Node {self.node} stops its workers and spares "
              f"({recovered}{finished} of {self.world_size} ranks had finished). Worker logs and the event log "
              f"are in {self.log_dir}/.", file=sys.stderr, flush=True)
        return 1

    def _lost_store(self, reason: str) -> int:
        """The store is gone: nothing can be written to it, so this agent stops on its
        own, and its workers with it; disk checkpoints stay where they are."""
        self._stopping = True
        self.events.write("store_lost", node=self.node, reason=reason)
        kept = f"; the disk checkpoints in {self.config.checkpoint_dir} are kept" if self.config.checkpoint_dir else ""
        print(f"peerstate: the job cannot go on: {reason.rstrip('.')}. Node {self.node} stops its workers and spares"
              f"{kept}. Worker logs and the event log are in {self.log_dir}/.", file=sys.stderr, flush=True)
        return 1

    def _kill_all(self) -> None:
        self._stopping = True
        if hasattr(self, "control"):
            self.control.close()
        for process in self.processes.values():
            if process.popen.poll() is None:
                process.signal_group(signal.SIGKILL)
            process.popen.wait()
            process.counter.close()
            process.exit_watch.close()
            try:
                os.unlink(process.counter.path)
            except FileNotFoundError:
                pass
        self.processes.clear()
        for popen in self._dying:
            popen.wait()
        self._dying.clear()
        if self._forks is not None:
            self._forks.close()
            self._forks = None
