"""Real peerstate jobs for the recovery tests: agents started with `peerstate run`
(one per simulated node, all on 127.0.0.1), faults injected with real signals,
and every process cleaned up, whatever happens."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

TRAIN_SCRIPT = Path(__file__).with_name("train_job.py")


class Job:
    def __init__(self, tmp_path, nodes, *, steps=40, agent_args=(), script_args=(), script=TRAIN_SCRIPT):
        """nodes: [(nproc_per_node, spares), ...], one agent each."""
        self.dir = Path(tmp_path)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.logs = self.dir / "logs"
        self.out = self.dir / "final.pt"
        self.nodes = nodes
        self.agents = []
        self.agent_logs = []
        command_tail = [*agent_args, str(script), "--steps", str(steps), "--out", str(self.out), *script_args]
        store = "127.0.0.1:0"
        for index, (nproc, spares) in enumerate(nodes):
            log = self.dir / f"agent{index}.err"
            self.agent_logs.append(log)
            command = [sys.executable, "-m", "peerstate", "run", "--nnodes", str(len(nodes)), "--node-rank",
                       str(index), "--store", store, "--nproc-per-node", str(nproc), "--spares", str(spares),
                       "--log-dir", str(self.logs), *command_tail]
            with open(log, "wb") as err:
                self.agents.append(subprocess.Popen(command, stdout=err, stderr=subprocess.STDOUT,
                                                    stdin=subprocess.DEVNULL, start_new_session=True))
            if index == 0 and len(nodes) > 1:
                store = self._store_address()

    def _store_address(self, timeout=60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(r"store at (\S+)", self.agent_logs[0].read_text())
            if match:
                return match.group(1)
            if self.agents[0].poll() is not None:
                raise RuntimeError(f"agent 0 exited: {self.agent_logs[0].read_text()}")
            time.sleep(0.02)
        raise TimeoutError("agent 0 did not announce its store")

    # -- observing ----------------------------------------------------------------
    def worker_logs(self):
        return sorted(self.logs.glob("n*.log"))

    def text(self):
        return "".join(p.read_text(errors="replace") for p in self.worker_logs())

    def events(self, kind=None):
        path = self.logs / "events.jsonl"
        if not path.exists():
            return []
        found = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [e for e in found if kind is None or e["event"] == kind]

    def wait_for(self, predicate, what, timeout=90.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if all(a.poll() is not None for a in self.agents):
                raise AssertionError(f"the job ended while waiting for {what}:\n{self.describe()}")
            time.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}:\n{self.describe()}")

    def wait_for_step(self, rank, step, timeout=90.0):
        pattern = re.compile(rf"^rank {rank} step (\d+)", re.M)
        return self.wait_for(lambda: any(int(s) >= step for s in pattern.findall(self.text())),
                             f"rank {rank} to reach step {step}", timeout)

    def pid_of(self, rank):
        """The live process that holds ``rank`` now."""
        pids = [int(p) for p in re.findall(rf"^rank {rank} pid (\d+)", self.text(), re.M)]
        live = [p for p in pids if _alive(p)]
        assert live, f"no live process holds rank {rank}:\n{self.describe()}"
        return live[-1]

    def spare_pids(self):
        """Pids of the spares waiting now, from the agents' event log and /proc."""
        ready = {e["source"] for e in self.events("spare_ready")}
        assigned = {e["source"] for e in self.events("spare_assigned")}
        pids = []
        for worker in ready - assigned:
            for pid in _pids_with_env("PEERSTATE_WORKER", worker):
                pids.append(pid)
        return pids

    # -- faults -------------------------------------------------------------------
    def _fault(self, what):
        line = json.dumps({"time": time.time(), "event": "fault_injected", "source": "test", "fault": what})
        with open(self.logs / "events.jsonl", "a") as f:
            f.write(line + "\n")

    def kill_rank(self, rank, sig=signal.SIGKILL):
        pid = self.pid_of(rank)
        self._fault(f"{signal.Signals(sig).name} rank {rank}")
        os.kill(pid, sig)
        return pid

    def kill_node(self, index):
        self._fault(f"SIGKILL node {index}")
        os.killpg(self.agents[index].pid, signal.SIGKILL)

    # -- ending -------------------------------------------------------------------
    def wait(self, timeout=120.0):
        """Return codes of every agent; kills everything if they do not end in time."""
        deadline = time.monotonic() + timeout
        try:
            return [a.wait(timeout=max(0.1, deadline - time.monotonic())) for a in self.agents]
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job did not end within {timeout}s:\n{self.describe()}") from None

    def describe(self):
        parts = [f"--- agent {i} (rc {a.poll()}):\n{log.read_text(errors='replace')[-3000:]}"
                 for i, (a, log) in enumerate(zip(self.agents, self.agent_logs))]
        for path in self.worker_logs():
            parts.append(f"--- {path.name}:\n" + "\n".join(
                line for line in path.read_text(errors="replace").splitlines()[-25:] if " step " not in line))
        return "\n".join(parts)

    def close(self):
        """Kill every agent still running; their workers and spares die with them
        (PR_SET_PDEATHSIG), and any straggler of this job is killed too."""
        for agent in self.agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            stragglers = _pids_with_env("PEERSTATE_EVENTS", str(self.logs / "events.jsonl"))
            if not stragglers:
                return
            for pid in stragglers:
                try:
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        raise AssertionError(f"processes of this job survived it: {stragglers}")


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] not in "ZX"
    except OSError:
        return False


def _pids_with_env(name, value):
    wanted = f"{name}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if wanted in f.read().split(b"\0") and _alive(int(entry)):
                    found.append(int(entry))
        except OSError:
            continue
    return found
