"""Real peerstate jobs for the recovery tests: peerstate.tools.local.LocalJob (one agent per
simulated node, all on 127.0.0.1) plus what the tests need to aim faults with real
signals, and a cleanup that leaves no process of the job behind."""

import json
import os
import re
import signal
import time
from pathlib import Path

from peerstate.tools.local import LocalJob, alive

TRAIN_SCRIPT = Path(__file__).with_name("train_job.py")
STEPS = 40  # of the recovery tests' jobs and their fault-free reference (tests/e2e/conftest.py)
# Failures detected in about a second and a half: the e2e tests' agent flags.
FAST = ["--lease-timeout", "1.5", "--hang-timeout", "1.5", "--spare-timeout", "30", "--join-timeout", "60"]


def assert_bitwise(job, reference):
    """The job's final parameters (what train_job.py's --out holds) equal ``reference``'s, bit for bit."""
    import torch

    final = torch.load(job.out)
    assert final.keys() == reference.keys()
    different = [k for k in final if not torch.equal(final[k], reference[k])]
    assert not different, f"parameters {different} differ from the fault-free run"


class Job(LocalJob):
    def __init__(self, tmp_path, nodes, *, steps=40, agent_args=(), script_args=(), script=TRAIN_SCRIPT, out=None,
                 store=None):
        """nodes: [(nproc_per_node, spares), ...], one agent each; ``out``: what the script's
        --out names (default: a file final.pt in tmp_path); ``store``: every agent's --store."""
        self.out = Path(out) if out is not None else Path(tmp_path) / "final.pt"
        super().__init__(tmp_path, nodes, [str(script), "--steps", str(steps), "--out", str(self.out),
                                           *script_args], agent_args=agent_args, store=store)

    def wait_for(self, predicate, what, timeout=90.0):
        try:
            return super().wait_for(predicate, what, timeout)
        except (RuntimeError, TimeoutError) as error:
            raise AssertionError(f"{error}:\n{self.describe()}") from None

    def wait_for_step(self, rank, step, timeout=90.0):
        pattern = re.compile(rf"^rank {rank} step (\d+)", re.M)
        return self.wait_for(lambda: any(int(s) >= step for s in pattern.findall(self.text())),
                             f"rank {rank} to reach step {step}", timeout)

    def pid_of(self, rank):
        """The live process that holds ``rank`` now."""
        live = self.rank_pids().get(rank)
        assert live, f"no live process holds rank {rank}:\n{self.describe()}"
        return live[-1]

    def spare_pids(self):
        """Pids of the spares waiting now (from the event log and /proc)."""
        assigned = {e["source"] for e in self.events("spare_assigned")}
        return [e["pid"] for e in self.events("spare_ready") if e["source"] not in assigned and alive(e["pid"])]

    def _fault(self, what):
        line = json.dumps({"time": time.time(), "event": "fault_injected", "source": "test", "fault": what})
        with open(self.logs / "events.jsonl", "a") as f:
            f.write(line + "\n")

    def kill_rank(self, rank, sig=signal.SIGKILL):
        return self.signal_process(self.pid_of(rank), sig, f"rank {rank}")

    def signal_process(self, pid, sig, what):
        """Send ``sig`` to ``pid`` (``what`` names it in the event log's fault)."""
        self._fault(f"{signal.Signals(sig).name} {what}")
        os.kill(pid, sig)
        return pid

    def kill_node(self, index):
        self._fault(f"SIGKILL node {index}")
        super().kill_node(index)

    def freeze_node(self, index, ranks):
        """SIGSTOP node ``index``'s agent and its workers of ``ranks``: nothing exits and
        no socket closes, as when a node drops off the network."""
        pids = [self.pid_of(rank) for rank in ranks]
        self._fault(f"SIGSTOP node {index}")
        os.killpg(self.agents[index].pid, signal.SIGSTOP)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)

    def wait(self, timeout=120.0):
        try:
            return super().wait(timeout)
        except TimeoutError as error:
            raise AssertionError(f"{error}:\n{self.describe()}") from None

    def describe(self):
        parts = [f"--- agent {i} (rc {a.poll()}):\n{log.read_text(errors='replace')[-3000:]}"
                 for i, (a, log) in enumerate(zip(self.agents, self.agent_logs))]
        for path in self.worker_logs():
            parts.append(f"--- {path.name}:\n" + "\n".join(
                line for line in path.read_text(errors="replace").splitlines()[-25:] if " step " not in line))
        return "\n".join(parts)

    def close(self):
        """Kill the agents (their workers and spares die with them: PR_SET_PDEATHSIG),
        then any straggler of this job, and fail if one survives."""
        super().close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            stragglers = self.leftover_processes()
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
