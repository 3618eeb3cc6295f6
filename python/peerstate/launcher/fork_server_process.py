"""The fork server's own process (see ``fork_server`` for why there is one, and for
the agent's side): its preload, its loop that forks a child per request and
reports each exit, and what a forked child does to become its script and to end
as that script would have. ``python -m peerstate.launcher.fork_server_process
--fd N`` starts one as a new interpreter; ``fork_server._ForkedServer`` runs
``run_server`` in a child of the agent itself. ``--script ARGV...`` runs a worker
in an interpreter of its own instead (``run_worker``), ended as a forked one is.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import json
import os
import select
import signal
import socket
import sys
import threading
import traceback
from typing import Callable, Dict, List, Mapping, NoReturn, Optional, Sequence

from peerstate.launcher.processes import die_with_parent

# torch._dynamo: every torch.optim optimizer imports it in its constructor (torch._disable_dynamo),
# 3-6 CPU-seconds on a busy core, most of a spare's start to ready when each worker paid it.
DEFAULT_PRELOAD = ("torch", "torch._dynamo", "peerstate.worker.job")


def imported_under(modules: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether this process holds ``modules`` imported under ``env``, as a server started
    with ``env`` would import them (OpenMP, for one, reads its thread count when torch
    loads): imported here now if none of them was yet, or by this process's own preload
    under that very environment (an agent forked from a fork server: ``LocalJob``'s)."""
    if not any(m in sys.modules for m in modules):
        with _environment(env):
            _preload(modules)
        return True
    return _preloaded_under == dict(env) and all(m in sys.modules for m in modules)


def take_over(parent: int, log: str, env: Mapping[str, str]) -> None:
    """In a child just forked from ``parent``: die with it (or now, if it is already
    gone: it may have died between the fork and the prctl), write to ``log``, read
    nothing, and run under ``env``."""
    die_with_parent()
    if os.getppid() != parent:
        os._exit(128 + signal.SIGKILL)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    for source, target in ((null, 0), (out, 1), (out, 2)):
        os.dup2(source, target)
    os.close(out)
    os.close(null)
    _replace_environment(env)


def _replace_environment(env: Mapping[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)


@contextlib.contextmanager
def _environment(env: Mapping[str, str]):
    """``os.environ`` is ``env`` inside, as it was before outside."""
    saved = dict(os.environ)
    _replace_environment(env)
    try:
        yield
    finally:
        _replace_environment(saved)


NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def _preload(modules: Sequence[str]) -> None:
    """Import ``modules`` as a server must: a CUDA availability check among them asks
    NVML, not the CUDA driver (``PYTORCH_NVML_BASED_CUDA_CHECK=1`` while they import,
    unless the environment sets it). torchtitan, for one, calls
    ``torch.cuda.is_available()`` as it loads; by the driver, that is a ``cuInit`` in
    the server, after which every worker forked from it finds CUDA unusable, and
    ``torch.cuda.is_initialized()`` does not show it. Workers get their own environment,
    without the setting."""
    default = NVML_CHECK not in os.environ
    if default:
        os.environ[NVML_CHECK] = "1"
    try:
        for module in modules:
            importlib.import_module(module)
    finally:
        if default:
            os.environ.pop(NVML_CHECK, None)


_preloaded_under: Optional[Dict[str, str]] = None  # the environment the server's preload ran in


def _serve(channel: socket.socket) -> dict:
    """Fork a child per request and report each child's exit, until the agent closes
    the channel (then exit). Returns only in a child, with its request."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd is written
    signal.set_wakeup_fd(wake_write)
    children: Dict[int, int] = {}  # pid -> request id
    buffer = b""
    while True:
        try:
            readable, _, _ = select.select([channel, wake_read], [], [])
        except InterruptedError:
            continue
        if wake_read in readable:
            os.read(wake_read, 4096)
        _report_exits(channel, children)
        if channel not in readable:
            continue
        data = channel.recv(65536)
        if not data:
            os._exit(0)  # the agent is done (or gone): the children die with this process
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_read)
                os.close(wake_write)
                channel.close()
                return request
            children[pid] = request["id"]
            _send(channel, {"started": request["id"], "pid": pid})


def _report_exits(channel: socket.socket, children: Dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(channel, {"exited": children.pop(pid, -1), "code": os.waitstatus_to_exitcode(status)})


def _send(channel: socket.socket, message: dict) -> None:
    channel.sendall(json.dumps(message).encode() + b"\n")


def _become(request: dict, server: int) -> None:
    """In the child: become ``python argv...`` with the request's environment and log."""
    os.setsid()
    take_over(server, request["log"], request["env"])
    os.chdir(request["cwd"])
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # fresh entropy, as a new interpreter would draw
    _run_script(list(request["argv"]))


def own_interpreter_command(argv: Sequence[str]) -> List[str]:
    """The command line of a worker that runs ``python ARGV...`` in an interpreter of its
    own (``run_worker``)."""
    return [sys.executable, "-m", "peerstate.launcher.fork_server_process", "--script", *argv]


def run_worker(argv: List[str]) -> NoReturn:
    """A worker with an interpreter of its own (``peerstate run --preload ''``:
    ``python -m peerstate.launcher.fork_server_process --script ARGV...``): ``python
    ARGV...``, ended as a forked worker ends. Not through the interpreter's own
    exit: a gloo group the script still holds (a ``DeviceMesh``'s) can abort a
    process there after its last step (pytorch#190489), and the agent would see a
    worker that finished die."""
    _end_as_forked_child(lambda: _run_script(argv))


def _run_script(argv: List[str]) -> None:
    import runpy

    if argv[0] == "-m":  # as `python -m MODULE ARGS`: the working directory first on the path
        sys.argv = argv[1:]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")


def _end_as_forked_child(script: Callable[[], None]) -> NoReturn:
    """Run ``script``, then end the process with the status ``python script.py``
    would have: 0; a SystemExit's code (its message said, and 1, for a non-integer
    one); 1 with the traceback for an uncaught exception; death by SIGINT for a
    KeyboardInterrupt. What the interpreter's own exit does that a script can
    notice is done first: non-daemon threads are waited for, atexit functions run,
    stdio is flushed."""
    code = 0
    interrupted = False
    try:
        script()
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:  # noqa: BLE001 - said as the interpreter would say it
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined] - what Py_Finalize and multiprocessing call
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream has nothing left to flush
                pass
        if interrupted:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code & 0xFF)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="peerstate's fork server (started by the agent)")
    parser.add_argument("--fd", type=int, required=True, help="the socket to the agent")
    parser.add_argument("--preload", default=",".join(DEFAULT_PRELOAD))
    args = parser.parse_args(argv)
    die_with_parent()
    run_server(socket.socket(fileno=args.fd), list(filter(None, args.preload.split(","))))


def run_server(channel: socket.socket, preload: List[str]) -> NoReturn:
    """Import ``preload`` (JobFailedError's reason said to the agent if that fails),
    then serve; a worker forked by ``_serve`` becomes its script and exits here."""
    global _preloaded_under
    environment = dict(os.environ)  # not after: an import may set a variable (torch._inductor's cache dir)
    try:
        _preload(preload)
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            raise RuntimeError("CUDA was initialised while preloading; a forked CUDA context is unusable")
        _preloaded_under = environment
    except BaseException as error:  # noqa: BLE001 - said to the agent, which stops the job with it
        _send(channel, {"error": f"preloading {','.join(preload)!r} failed: {type(error).__name__}: {error} (start "
                                 "workers with their own interpreter: peerstate run --preload '')"})
        raise
    server = os.getpid()
    request = _serve(channel)
    _end_as_forked_child(lambda: _become(request, server))


if __name__ == "__main__":
    # As the package's module, not as __main__: what the server forks reads its _preloaded_under.
    from peerstate.launcher import fork_server_process

    if sys.argv[1:2] == ["--script"]:
        fork_server_process.run_worker(sys.argv[2:])
    fork_server_process.main()
