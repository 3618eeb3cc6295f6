"""Workers and spares forked from one process that has imported torch already.

A worker's interpreter start and ``import torch`` take 2-4 s of a busy core;
a node paid them for every worker, every spare and every refill, and a
recovery that needed a spare being refilled waited for them. The agent
instead starts one *fork server* per node: it imports the ``preload`` modules
once, then forks a child per request, which becomes the script as ``python
script.py ARGS`` would run it (``runpy.run_path`` as ``__main__``, the
request's argv, environment, working directory and log; its own session;
SIGKILL when its parent dies). A spare is then ready in the time its script
takes to reach ``track()``'s wait, less what the preload imported (by default
torch, torch._dynamo, which torch's optimizers import, and peerstate).

The agent needs torch too (its stores are torch's TCPStore), and a second
``import torch`` was 2 CPU-seconds of every node's start (a 2-node test job
of 5 workers took 13 CPU-seconds to run, 10 without it). So the agent's
first server is forked from the agent itself, right after the agent
imported torch under the workers' environment and before it starts any
thread (``ForkServer``'s ``share``); a server started later (the first one
died) is a new interpreter, ``python -m peerstate.launcher.fork_server_process``, as
is the first one wherever the fork is not safe.

What differs from a fresh interpreter, on purpose and said here: modules
preloaded are imported once with the server's environment (the per-worker
variables, ``PEERSTATE_*``, ``RANK`` and the like, are set before the
script runs: torch reads them at ``init_process_group``, not at import);
numpy's global random state is reseeded in each child (Python's ``random``
reseeds itself at fork); the hash seed is the server's, the same in every
worker. The server never initialises CUDA (it refuses to fork once CUDA is
initialised: a forked CUDA context is unusable; a preloaded module's
``torch.cuda.is_available()`` asks NVML, see ``fork_server_process._preload``),
and it runs no thread of its own (numpy's OpenBLAS pool has its own fork
handlers). A child ends as multiprocessing's forked children do
(``fork_server_process._end_as_forked_child``): it waits for its non-daemon
threads, runs its atexit functions (``Job.close`` among them) and flushes,
then ``os._exit``s with the exit status the script would have had, without the
interpreter's teardown of the preloaded modules (a collection of
torch's module graph and its C++ static destructors: 1-2 s of a loaded core at
every worker's exit, which the job's end waited for).

The agent's side is here: ``ForkServer`` (start, ``spawn``) and ``ForkedProcess``,
which answers as ``subprocess.Popen`` does (``pid``, ``poll``, ``wait``,
``returncode``): the server is the workers' parent and reaps them, and tells
the agent each exit status over their socket. What runs in the server and in
each child it forks is ``fork_server_process``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Dict, List, Mapping, Optional, Sequence, Union

from peerstate.errors import JobFailedError
from peerstate.launcher.fork_server_process import DEFAULT_PRELOAD, imported_under, run_server, take_over
from peerstate.launcher.processes import die_with_parent

__all__ = ["DEFAULT_PRELOAD", "ForkServer", "ForkedProcess"]


class ForkedProcess:
    """A worker the fork server started, seen as ``subprocess.Popen`` sees a child.

    ``poll()`` never blocks; ``wait()`` blocks until the server reports the exit
    (the server reports every child it reaps; if the server itself is gone, its
    children died with it, by SIGKILL)."""

    def __init__(self, server: "ForkServer", request: int, pid: int) -> None:
        self._server = server
        self._request = request
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self._request)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.poll() is None:
            code = self._server.wait_exit(self._request, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            self.returncode = code
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The agent's handle on its node's fork server (see the module docstring).

    ``spawn`` blocks until the server has forked (the first call also waits for its
    preload, a few seconds); it raises JobFailedError when the server is gone or
    cannot fork (its preload failed: the reason is in ``log``). Thread-safe: the
    agent's loop spawns, a reader thread takes the server's answers as they come, and
    ``exit_code`` first takes in every answer the server has written by then (see
    ``_take_answers``)."""

    def __init__(self, preload: List[str], env: Mapping[str, str], log: str, share: Sequence[str] = ()) -> None:
        """``share``: modules this process needs too (the agent: ``torch.distributed``,
        for its stores). Where no other Python thread runs and none of them is imported
        yet, they are imported here under ``env``, as the server would import them, and
        the server is forked from this process (see ``_ForkedServer``): a node pays for
        them once, not twice. So it is, too, where this process was forked from a server
        whose preload imported them under ``env`` itself (``LocalJob``'s agents).
        Otherwise the server is a new interpreter."""
        self.preload = list(preload)
        self.log = log
        ours, theirs = socket.socketpair()
        if share and threading.active_count() == 1 and imported_under(share, env):
            self._popen: Union[subprocess.Popen, _ForkedServer] = _ForkedServer.start(theirs, ours, self.preload,
                                                                                      env, log)
        else:
            with open(log, "ab") as out:
                self._popen = subprocess.Popen(
                    [sys.executable, "-m", "peerstate.launcher.fork_server_process", "--fd", str(theirs.fileno()),
                     "--preload", ",".join(self.preload)],
                    env=dict(env), pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=out,
                    stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        theirs.close()
        self._socket = ours
        self._changed = threading.Condition()
        self._started: Dict[int, int] = {}   # request id -> pid
        self._exits: Dict[int, int] = {}     # request id -> exit status (Popen.returncode form), pids are reused
        self._error: Optional[str] = None    # why the server cannot fork (its own words), or that it is gone
        self._next_request = 0
        self._send = threading.Lock()
        self._receive = threading.Lock()     # held from a recv until what it read is taken in
        self._buffer = b""                   # a partial answer, under _receive
        self._closed = False                 # the server's end is closed, under _receive
        self._reader = threading.Thread(target=self._read, name="fork-server", daemon=True)
        self._reader.start()

    def alive(self) -> bool:
        with self._changed:
            return self._error is None

    def spawn(self, argv: List[str], env: Mapping[str, str], log: str, timeout: float = 120.0) -> ForkedProcess:
        """Start ``python argv...`` (argv[0] the script, or ``-m`` and a module) as a child
        of the server."""
        open(log, "ab").close()  # there once spawn returns, as with Popen's stdout
        with self._send:
            request = self._next_request
            self._next_request += 1
            message = {"id": request, "argv": list(argv), "env": dict(env), "log": log, "cwd": os.getcwd()}
            try:
                self._socket.sendall(json.dumps(message).encode() + b"\n")
            except OSError as error:
                self._take_answers()  # a server whose preload failed said why before it went: say that
                with self._changed:
                    reason = self._error or f"it is gone ({error}); its output is in {self.log}"
                raise JobFailedError(f"the fork server cannot start workers: {reason}") from None
        with self._changed:
            if not self._changed.wait_for(lambda: request in self._started or self._error, timeout):
                raise JobFailedError(f"the fork server did not start a worker within {timeout:.0f}s "
                                     f"(its output is in {self.log})")
            if request not in self._started:
                raise JobFailedError(f"the fork server cannot start workers: {self._error}")
            return ForkedProcess(self, request, self._started.pop(request))

    def exit_code(self, request: int) -> Optional[int]:
        """The exit status of ``request``'s child, if the server has reported it by now
        (never blocks for long: at most until the reader has taken in what it read)."""
        self._take_answers()
        with self._changed:
            return self._exits.get(request)

    def wait_exit(self, request: int, timeout: Optional[float]) -> Optional[int]:
        with self._changed:
            self._changed.wait_for(lambda: request in self._exits, timeout)
            return self._exits.get(request)

    def close(self) -> None:
        """Stop the server (its children, if any are left, die with it)."""
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._popen.kill()
            self._popen.wait()
        self._reader.join(timeout=5)
        self._socket.close()

    def _read(self) -> None:
        while not self._closed:
            try:
                select.select([self._socket], [], [])
            except (OSError, ValueError):
                pass  # closed: _take_answers sees it
            self._take_answers()

    def _take_answers(self) -> None:
        """Take in every answer the server has written by now, without waiting for more.
        Why not just the reader thread: the agent's watch reads several workers' exits in
        one pass, and a pass must see every exit reported before it began (workers lost
        together are planned for together). An exit the reader had not yet taken in would
        reach the next pass alone. The lock keeps answers in order, and makes a caller wait
        for the reader's recv to be taken in rather than read past it."""
        with self._receive:
            if self._closed:
                return
            while True:
                try:
                    data = self._socket.recv(65536, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    return
                except OSError:
                    data = b""
                if not data:
                    self._close_answers()
                    return
                self._buffer += data
                *lines, self._buffer = self._buffer.split(b"\n")
                with self._changed:
                    for line in lines:
                        message = json.loads(line)
                        if "started" in message:
                            self._started[message["started"]] = message["pid"]
                        elif "exited" in message:
                            self._exits[message["exited"]] = message["code"]
                        elif "error" in message:
                            self._error = message["error"]
                    self._changed.notify_all()

    def _close_answers(self) -> None:
        self._closed = True
        with self._changed:
            # PR_SET_PDEATHSIG: whatever the server had started died with it.
            for request in range(self._next_request):
                self._exits.setdefault(request, -signal.SIGKILL)
            self._error = self._error or f"the fork server exited (its output is in {self.log})"
            self._changed.notify_all()


class _ForkedServer:
    """A server forked from the agent itself, seen as the ``Popen`` of an exec'd one
    (``pid``, ``poll``, ``wait``, ``kill``). Its child starts from the agent's
    memory, so it sheds what is the agent's: buffered output (flushed before the
    fork), its stdio (the server's log instead), the Python signal handlers the agent
    installed (default again) and its environment (``env``, which the ``share``d
    modules were imported under). It never returns into the agent's code: it serves,
    or exits 1 saying why. The agent's other descriptors stay open in it, unused.
    /proc/PID/environ shows the agent's environment, not ``env``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None

    @classmethod
    def start(cls, channel: socket.socket, agents_end: socket.socket, preload: List[str], env: Mapping[str, str],
              log: str) -> "_ForkedServer":
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        agent = os.getpid()
        pid = os.fork()
        if pid:
            return cls(pid)
        try:
            agents_end.close()
            take_over(agent, log, env)
            for signum in signal.valid_signals():
                handler = signal.getsignal(signum)
                if callable(handler) and handler is not signal.default_int_handler:
                    signal.signal(signum, signal.SIG_DFL)
            run_server(channel, preload)
        except BaseException:  # noqa: BLE001 - never back into the agent's code
            traceback.print_exc()
        finally:
            os._exit(1)

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"fork server {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
