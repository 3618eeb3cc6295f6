"""Jobs on this one machine: simulated nodes for the demo, the benchmarks and the tests.

``LocalJob`` starts one ``peerstate run`` agent per simulated node, all on
127.0.0.1 (node 0 hosts the store on a port the kernel picks; the others
learn it from node 0's first line). ``start_plain_workers`` starts a script
the classic way, torch.distributed without peerstate, for restart baselines.
Every process is started in its own session so that it can be killed whole.

The agents are forked from one *starter* (a ``launcher.fork_server``) that has
imported torch, the agent and the workers' preload once, under the environment
a node's fork server would have: each agent then forks its own fork server from
itself (``ForkServer``'s ``share``), and a job of N simulated nodes imports
them once, not N times (4.3 CPU-seconds a node, most of a short test job's CPU).
Each agent is still its own process, session and node, as on a real node; where
the starter cannot be used (its preload fails, the command line does not parse)
the agents are new interpreters, ``python -m peerstate run``, as on real nodes.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from peerstate.control.timeline import read_events
from peerstate.errors import Error, JobFailedError
from peerstate.launcher.command_line import agent_config, agent_environment, parse_run_arguments
from peerstate.launcher.fork_server import ForkedProcess, ForkServer


class LocalJob:
    """``nodes``: (workers, spares) per simulated node; ``script``: the script and its
    arguments; ``agent_args``: more ``peerstate run`` flags for every agent; ``store``:
    the ``--store`` of every agent, or a list of one per agent (default: node 0
    hosts a TCPStore)."""

    def __init__(self, workdir: Path, nodes: Sequence[Tuple[int, int]], script: Sequence[str],
                 agent_args: Sequence[str] = (), store_timeout: float = 60.0,
                 store: Union[None, str, Sequence[str]] = None) -> None:
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.logs = self.dir / "logs"
        self.agents: List[Union[subprocess.Popen, ForkedProcess]] = []
        self.agent_logs: List[Path] = []
        hosted = store is None
        stores = [store] * len(nodes) if isinstance(store, str) else list(store or ["127.0.0.1:0"] * len(nodes))
        # The simulated nodes share one secret, as real ones would share a file or PEERSTATE_SECRET.
        secret_file = self.dir / "job.secret"
        if not secret_file.exists():
            descriptor = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w") as out:
                out.write(secrets.token_hex(32))
        # Every process of the job carries its event log in its environment (leftover_processes):
        # the agents', which what they fork shares (their fork server, its workers).
        marked = dict(os.environ, PEERSTATE_EVENTS=str(self.logs / "events.jsonl"))
        self._starter: Optional[ForkServer] = None
        for index, (workers, spares) in enumerate(nodes):
            log = self.dir / f"agent{index}.log"
            self.agent_logs.append(log)
            command = ["-m", "peerstate", "run", "--nnodes", str(len(nodes)), "--node-rank", str(index), "--store",
                       stores[index], "--nproc-per-node", str(workers), "--spares", str(spares), "--log-dir",
                       str(self.logs), "--secret-file", str(secret_file), *agent_args, *script]
            if index == 0 and len(nodes) > 1:
                self._starter = _starter(command, marked, self.dir / "starter.log")
            self.agents.append(self._start_agent(command, marked, log))
            if hosted and index == 0 and len(nodes) > 1:
                stores[1:] = [self.wait_for(lambda: re.search(r"store at (\S+)", log.read_text()), "node 0's store",
                                            store_timeout).group(1)] * (len(nodes) - 1)

    def _start_agent(self, command: List[str], env: Dict[str, str], log: Path) -> Union[subprocess.Popen,
                                                                                       ForkedProcess]:
        open(log, "wb").close()  # the agent's own, from the start (spawn and Popen append)
        if self._starter is not None:
            try:
                return self._starter.spawn(command, env, str(log))
            except JobFailedError:  # its preload failed (the reason is in starter.log): as on a real node
                self._close_starter()
        with open(log, "ab") as out:
            return subprocess.Popen([sys.executable, *command], stdout=out, stderr=subprocess.STDOUT, env=env,
                                    stdin=subprocess.DEVNULL, start_new_session=True)

    def worker_logs(self) -> List[Path]:
        return sorted(self.logs.glob("n*.log"))

    def text(self) -> str:
        """Every worker's output so far."""
        return "".join(p.read_text(errors="replace") for p in self.worker_logs())

    def events(self, kind: Optional[str] = None) -> List[dict]:
        path = self.logs / "events.jsonl"
        if not path.exists():
            return []
        found = read_events(str(path))
        return [e for e in found if kind is None or e["event"] == kind]

    def wait_for(self, predicate: Callable[[], object], what: str, timeout: float = 90.0):
        """Poll ``predicate`` until it returns something true; TimeoutError or
        RuntimeError (every agent exited) otherwise."""
        return wait_until(predicate, what, timeout, self.agents)

    def wait(self, timeout: float = 300.0, tick: Optional[Callable[[], None]] = None) -> List[int]:
        """Every agent's exit code (``tick`` is called while waiting)."""
        deadline = time.monotonic() + timeout
        while any(a.poll() is None for a in self.agents):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the job did not end within {timeout:.0f}s")
            if tick:
                tick()
            time.sleep(0.1)
        self._close_starter()
        return [a.returncode for a in self.agents]

    def rank_pids(self) -> Dict[int, List[int]]:
        """rank -> the live processes that held it, oldest first (from the scripts'
        ``rank R pid P`` lines: the one that holds it now is the last)."""
        held: Dict[int, List[int]] = {}
        for rank, pid in re.findall(r"^rank (\d+) pid (\d+)", self.text(), re.M):
            if alive(int(pid)):
                held.setdefault(int(rank), []).append(int(pid))
        return held

    def leftover_processes(self) -> List[int]:
        """Processes of this job still running, agents included (they carry its event log
        in their environment)."""
        return processes_with_env("PEERSTATE_EVENTS", str(self.logs / "events.jsonl"))

    def kill_node(self, index: int) -> None:
        os.killpg(self.agents[index].pid, signal.SIGKILL)

    def close(self) -> None:
        """Kill every agent still running (their workers and spares die with them)."""
        for agent in self.agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
        self._close_starter()

    def _close_starter(self) -> None:
        """Stop the starter (any agent it started and still runs dies with it)."""
        if self._starter is not None:
            self._starter.close()
            self._starter = None


def _starter(command: List[str], environ: Dict[str, str], log: Path) -> Optional[ForkServer]:
    """A fork server for a job's agents (see the module docstring), which imports what
    node ``command``'s agent and its fork server would, in its fork server's environment;
    None where ``command`` is not one ``peerstate run`` takes (its agent says why)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args = parse_run_arguments(command[3:])
        environment = agent_environment(environ)
        config = agent_config(args, environment)
    except (SystemExit, Error):
        return None
    return ForkServer(["torch.distributed", "peerstate.launcher.agent", *config.preload],
                      config.fork_server_environment(environment), str(log))


def wait_until(predicate: Callable[[], object], what: str, timeout: float,
               processes: Sequence[subprocess.Popen], interval: float = 0.02):
    """Poll ``predicate`` until it returns something true and return that;
    RuntimeError once every one of ``processes`` exited, TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if processes and all(p.poll() is not None for p in processes):
            raise RuntimeError(f"the job ended while waiting for {what}")
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what}")


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (not a zombie, not gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] not in "ZX"
    except OSError:
        return False


def processes_with_env(name: str, value: str) -> List[int]:
    """The live processes whose environment has ``name=value``."""
    wanted = f"{name}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if wanted in f.read().split(b"\0") and alive(int(entry)):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def resident_bytes(pid: int) -> Optional[int]:
    """The resident memory of ``pid`` (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_plain_workers(script: Sequence[str], world_size: int, log_prefix: Path,
                        env: Optional[Dict[str, str]] = None) -> List[subprocess.Popen]:
    """``world_size`` processes of ``script`` with torchrun's environment (rank 0 hosts
    the rendezvous on a free port); rank r writes ``{log_prefix}.rank{r}.log``."""
    port = free_port()
    processes = []
    for rank in range(world_size):
        variables = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                         LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                         TORCH_CPP_LOG_LEVEL="ERROR", GLOO_SOCKET_IFNAME="lo", **(env or {}))
        with open(f"{log_prefix}.rank{rank}.log", "wb") as log:
            processes.append(subprocess.Popen([sys.executable, *script], env=variables, stdout=log,
                                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True))
    return processes


def kill_all(processes: Sequence[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
