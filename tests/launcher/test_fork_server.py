"""The fork server (``peerstate.launcher.fork_server``): a worker forked from it runs
its script as ``python script.py ARGS`` would, its exits are reported as
``Popen`` reports them, and nothing it started outlives the agent or the server."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

from peerstate.errors import JobFailedError  # noqa: E402
from peerstate.launcher.fork_server import DEFAULT_PRELOAD, ForkServer  # noqa: E402
from peerstate.launcher.fork_server_process import own_interpreter_command  # noqa: E402
from peerstate.tools.local import alive, wait_until  # noqa: E402

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import numpy
    what = sys.argv[1]
    if what == "sleep":
        print("sleeping", flush=True)
        import time
        time.sleep(120)
    if what == "raise":
        raise ValueError("this script raised")
    with open(sys.argv[2], "w") as f:
        json.dump({"name": __name__, "file": __file__, "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
                   "env": os.environ.get("WORKER_SETTING"), "random": int(numpy.random.randint(1 << 30)),
                   "torch": "torch" in sys.modules}, f)
    sys.exit(int(sys.argv[3]))
""")


@pytest.fixture
def server(tmp_path):
    forks = ForkServer(["torch", "numpy"], dict(os.environ), str(tmp_path / "server.log"))
    yield forks
    forks.close()


def test_a_forked_worker_runs_its_script_as_a_fresh_interpreter_would(tmp_path, server):
    script = tmp_path / "scripts" / "worker.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    env = dict(os.environ, WORKER_SETTING="set for this worker")
    forked = [server.spawn([str(script), "report", str(tmp_path / f"forked{i}.json"), "3"], env,
                           str(tmp_path / f"forked{i}.log")) for i in range(2)]
    assert [p.wait(timeout=60) for p in forked] == [3, 3]
    plain = subprocess.run([sys.executable, str(script), "report", str(tmp_path / "plain.json"), "3"], env=env,
                           timeout=60)
    assert plain.returncode == 3
    ran = [json.loads((tmp_path / f"forked{i}.json").read_text()) for i in range(2)]
    reference = json.loads((tmp_path / "plain.json").read_text())
    same = ("name", "file", "cwd", "path0", "env")
    for seen in ran:
        assert {k: seen[k] for k in same} == {k: reference[k] for k in same}
        assert seen["torch"]  # preloaded
    assert ran[0]["argv"][0] == str(script) and ran[0]["argv"][2].endswith("forked0.json")
    assert ran[0]["random"] != ran[1]["random"]  # numpy's global state reseeded in each child


def test_exits_are_reported_as_popen_reports_them(tmp_path, server):
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    raised = server.spawn([str(script), "raise"], dict(os.environ), str(tmp_path / "raised.log"))
    sleeping = server.spawn([str(script), "sleep"], dict(os.environ), str(tmp_path / "sleeping.log"))
    assert raised.wait(timeout=60) == 1
    assert "ValueError: this script raised" in (tmp_path / "raised.log").read_text()
    wait_until(lambda: "sleeping" in (tmp_path / "sleeping.log").read_text(), "the worker to start", 60, [])
    assert sleeping.poll() is None
    assert os.getpgid(sleeping.pid) == sleeping.pid  # its own session: the agent signals its group
    os.killpg(sleeping.pid, signal.SIGKILL)
    assert sleeping.wait(timeout=10) == -signal.SIGKILL
    with pytest.raises(subprocess.TimeoutExpired):
        server.spawn([str(script), "sleep"], dict(os.environ), str(tmp_path / "other.log")).wait(timeout=0.2)


ENDINGS = textwrap.dedent("""
    import atexit, sys, threading, time
    marks = sys.argv[2]
    atexit.register(lambda: open(marks, "a").write("atexit ran\\n"))
    def late():
        time.sleep(0.5)
        open(marks, "a").write("non-daemon thread finished\\n")
    threading.Thread(target=late).start()
    class Finalised:
        def __del__(self, open=open, marks=marks):  # the interpreter's teardown of the globals
            open(marks, "a").write("finalised by the interpreter\\n")
    held = Finalised()
    print("buffered, never flushed by the script", end="")
    what = sys.argv[1]
    if what == "message":
        sys.exit("the script's own message")
    if what == "code":
        sys.exit(3)
""")


def _own_interpreter(argv, env, log):
    """A worker as the agent starts it under ``--preload ''``."""
    with open(log, "ab") as out:
        return subprocess.Popen(own_interpreter_command(argv), env=env, stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.parametrize("started", ["forked", "own-interpreter"])
@pytest.mark.parametrize("how, code", [("code", 3), ("message", 1), ("end", 0)])
def test_a_worker_ends_as_its_interpreter_would(tmp_path, request, started, how, code):
    # It skips the interpreter's teardown (of what the server preloaded; of a gloo group the
    # script still holds, pytorch#190489), and nothing else: its non-daemon threads finish,
    # its atexit functions run (after them, as in Py_Finalize), its buffered output is
    # flushed, its exit status is the script's. Forked or in an interpreter of its own.
    spawn = request.getfixturevalue("server").spawn if started == "forked" else _own_interpreter
    script, marks, log = tmp_path / "ending.py", tmp_path / "marks.txt", tmp_path / "ending.log"
    script.write_text(ENDINGS)
    assert spawn([str(script), how, str(marks)], dict(os.environ), str(log)).wait(timeout=60) == code
    assert marks.read_text().splitlines() == ["non-daemon thread finished", "atexit ran"]
    text = log.read_text()
    assert "buffered, never flushed by the script" in text
    assert ("the script's own message" in text) == (how == "message"), text


def test_workers_die_with_a_killed_server_and_are_reported_killed(tmp_path, server):
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    sleeping = server.spawn([str(script), "sleep"], dict(os.environ), str(tmp_path / "sleeping.log"))
    wait_until(lambda: "sleeping" in (tmp_path / "sleeping.log").read_text(), "the worker to start", 60, [])
    os.kill(server._popen.pid, signal.SIGKILL)
    assert sleeping.wait(timeout=10) == -signal.SIGKILL
    wait_until(lambda: not alive(sleeping.pid), "the worker to die with its server", 10, [])
    assert not server.alive()
    with pytest.raises(JobFailedError, match="fork server"):
        server.spawn([str(script), "sleep"], dict(os.environ), str(tmp_path / "late.log"))


def test_the_server_and_its_workers_die_with_the_agent(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    agent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys, time
        from peerstate.launcher.fork_server import ForkServer
        forks = ForkServer(["torch"], dict(os.environ), {str(tmp_path / 'server.log')!r})
        worker = forks.spawn([{str(script)!r}, "sleep"], dict(os.environ), {str(tmp_path / 'worker.log')!r})
        print(forks._popen.pid, worker.pid, flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        server, worker = map(int, agent.stdout.readline().split())
        wait_until(lambda: "sleeping" in (tmp_path / "worker.log").read_text(), "the worker to start", 60, [])
        agent.kill()
        agent.wait()
        wait_until(lambda: not alive(server) and not alive(worker), "the server and its worker to die", 10, [])
    finally:
        agent.kill()
        agent.wait()


AGENT = textwrap.dedent("""
    import json, os, signal, sys, threading, time
    from peerstate.launcher.fork_server import ForkServer
    log_dir, script, with_thread = sys.argv[1], sys.argv[2], sys.argv[3] == "thread"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the agent's, as peerstate run installs it
    if with_thread:
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    threads = "1"  # not torch's default: one per core (and torch caps it there)
    env = dict(os.environ, OMP_NUM_THREADS=threads)
    sys.path.insert(0, log_dir)  # still_buffered: prints as it is imported, the last before the fork
    forks = ForkServer(["torch", "numpy"], env, os.path.join(log_dir, "server.log"), share=["torch", "still_buffered"])
    worker = forks.spawn([script, os.path.join(log_dir, "worker.json")], env, os.path.join(log_dir, "worker.log"))
    code = worker.wait(timeout=120)
    import torch
    with open(f"/proc/{forks._popen.pid}/cmdline", "rb") as f:
        server_command = f.read().split(b"\\0")
    report = {"code": code, "threads": threads, "agent_env": os.environ.get("OMP_NUM_THREADS"),
              "agent_torch_threads": torch.get_num_threads(), "server": forks._popen.pid,
              "server_exec": b"peerstate.launcher.fork_server_process" in server_command}
    forks.close()
    print(json.dumps(report), flush=True)
""")

WORKER = textwrap.dedent("""
    import json, os, signal, sys
    import torch
    with open(sys.argv[1], "w") as f:
        json.dump({"threads": torch.get_num_threads(), "parent": os.getppid(),
                   "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL}, f)
""")


@pytest.mark.skipif(os.cpu_count() < 2, reason="torch's default thread count is 1 here, as the test's setting")
@pytest.mark.parametrize("agent_has_a_thread", [False, True], ids=["forked-from-the-agent", "new-interpreter"])
def test_a_server_forked_from_the_agent_imports_torch_once_and_gives_workers_their_own_start(tmp_path,
                                                                                              agent_has_a_thread):
    """The agent imports torch for its stores; with ``share``, its fork server is forked
    from it after that import instead of importing torch again. What a worker sees is the
    same either way: the thread count its environment sets (read when torch loads), the
    default SIGTERM, none of the agent's buffered output. An agent that already runs a
    thread (a fork would copy a lock it holds) gets a new interpreter."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    (tmp_path / "still_buffered.py").write_text('print("the agent\'s own output, still buffered", end="")\n')
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONUNBUFFERED")}
    agent = subprocess.run([sys.executable, "-c", AGENT, str(tmp_path), str(script),
                            "thread" if agent_has_a_thread else "no-thread"], env=env,
                           capture_output=True, text=True, timeout=180)
    assert agent.returncode == 0, agent.stdout + agent.stderr
    report = json.loads(agent.stdout.rsplit("buffered", 1)[-1])
    worker = json.loads((tmp_path / "worker.json").read_text())
    assert report["code"] == 0, (tmp_path / "worker.log").read_text()
    assert report["server_exec"] == agent_has_a_thread, report
    assert worker == {"threads": int(report["threads"]), "parent": report["server"], "sigterm_default": True}
    assert report["agent_env"] is None  # the agent's own environment is as it was
    # Forked: the agent's torch is the server's, loaded under the workers' environment.
    assert (report["agent_torch_threads"] == int(report["threads"])) == (not agent_has_a_thread), report
    assert "the agent's own output" not in (tmp_path / "worker.log").read_text()
    assert agent.stdout.count("the agent's own output") == (0 if agent_has_a_thread else 1)  # once, by the agent


def test_a_preload_that_fails_says_which_and_how_to_do_without(tmp_path):
    forks = ForkServer(["peerstate_no_such_module"], dict(os.environ), str(tmp_path / "server.log"))
    try:
        with pytest.raises(JobFailedError, match="peerstate_no_such_module.*--preload ''"):
            forks.spawn([str(tmp_path / "worker.py")], dict(os.environ), str(tmp_path / "worker.log"))
    finally:
        forks.close()
    assert forks._popen.poll() is not None


def test_a_server_forked_from_the_agent_whose_preload_fails_says_why_and_never_returns_into_the_agent(tmp_path):
    # Forked, the server fails at once, and it is gone before the agent's first request:
    # the agent still says why (the server's words, not a broken pipe).
    agent = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os
        from peerstate.errors import JobFailedError
        from peerstate.launcher.fork_server import ForkServer
        forks = ForkServer(["peerstate_no_such_module"], dict(os.environ), {str(tmp_path / 'server.log')!r},
                           share=["colorsys"])
        forks._popen.wait(timeout=60)
        try:
            forks.spawn(["worker.py"], dict(os.environ), {str(tmp_path / 'worker.log')!r})
        except JobFailedError as error:
            print("refused:", error)
        forks.close()
        print("forked:", type(forks._popen).__name__, "exit:", forks._popen.poll())
    """)], capture_output=True, text=True, timeout=120)
    assert agent.returncode == 0, agent.stdout + agent.stderr
    refused, ended = agent.stdout.splitlines()
    assert "peerstate_no_such_module" in refused and "--preload ''" in refused, refused
    assert ended == "forked: _ForkedServer exit: 1", ended
    server_log = (tmp_path / "server.log").read_text()  # the server's stdout and stderr
    assert "ModuleNotFoundError" in server_log, server_log
    # Its one traceback, and nothing else: no agent code ran there after it.
    assert server_log.count("Traceback") == 1 and "refused:" not in server_log, server_log


OPTIMIZER_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    before = set(sys.modules)
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))], lr=1e-3)
    with open(sys.argv[1], "w") as f:
        json.dump(sorted(set(sys.modules) - before), f)
""")


@pytest.mark.e2e
def test_a_forked_worker_builds_its_optimizer_without_importing_anything_heavy(tmp_path):
    """The default preload holds what torch's optimizers import when they are built
    (torch._dynamo: seconds of a spare's start, on its way to ready)."""
    script = tmp_path / "optimizer.py"
    script.write_text(OPTIMIZER_SCRIPT)
    forks = ForkServer(list(DEFAULT_PRELOAD), dict(os.environ), str(tmp_path / "server.log"))
    try:
        forked = forks.spawn([str(script), str(tmp_path / "imported.json")], dict(os.environ),
                             str(tmp_path / "forked.log"))
        assert forked.wait(timeout=120) == 0, (tmp_path / "forked.log").read_text()
    finally:
        forks.close()
    imported = json.loads((tmp_path / "imported.json").read_text())
    assert not [m for m in imported if m.startswith(("torch._dynamo", "sympy"))], imported


STARTED_AGENT = textwrap.dedent("""
    import json, os, sys
    from peerstate.launcher.fork_server import ForkServer
    log_dir, script, threads = sys.argv[1:4]
    env = dict(os.environ, OMP_NUM_THREADS=threads)
    forks = ForkServer(["torch"], env, os.path.join(log_dir, "server.log"), share=["torch"])
    worker = forks.spawn([script, os.path.join(log_dir, "worker.json")], env, os.path.join(log_dir, "worker.log"))
    report = {"code": worker.wait(timeout=120), "server": forks._popen.pid,
              "forked": type(forks._popen).__name__ == "_ForkedServer"}
    forks.close()
    print(json.dumps(report), flush=True)
""")


@pytest.mark.skipif(os.cpu_count() < 2, reason="torch's default thread count is 1 here, as the test's setting")
@pytest.mark.parametrize("threads", ["1", "2"], ids=["preloaded-under-the-workers-environment", "under-another"])
def test_an_agent_forked_from_a_starter_forks_its_server_only_where_the_preload_had_the_workers_environment(
        tmp_path, threads):
    """LocalJob forks its agents from one starter that imported torch under a node's
    fork-server environment (OMP_NUM_THREADS=1 here). An agent whose workers' environment
    is that one forks its server from itself; any other gets a new interpreter, and
    either way its workers see the thread count of their own environment."""
    (tmp_path / "agent.py").write_text(STARTED_AGENT)
    (tmp_path / "worker.py").write_text(WORKER)
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    starter = ForkServer(["torch"], dict(base, OMP_NUM_THREADS="1"), str(tmp_path / "starter.log"))
    try:
        agent = starter.spawn([str(tmp_path / "agent.py"), str(tmp_path), str(tmp_path / "worker.py"), threads],
                              base, str(tmp_path / "agent.log"))
        assert agent.wait(timeout=180) == 0, (tmp_path / "agent.log").read_text()
    finally:
        starter.close()
    report = json.loads((tmp_path / "agent.log").read_text().splitlines()[-1])
    worker = json.loads((tmp_path / "worker.json").read_text())
    assert report["code"] == 0 and report["forked"] == (threads == "1"), report
    assert worker["threads"] == int(threads) and worker["parent"] == report["server"], (worker, report)


REPORT_NVML_CHECK = ('import json, os\n'
                     'with open(os.environ["REPORT_TO"] + "." + __name__, "w") as f:\n'
                     '    json.dump(os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"), f)\n')


@pytest.mark.parametrize("user_setting", [None, "0"], ids=["default", "set-by-the-user"])
def test_a_preload_checks_cuda_through_nvml_and_the_workers_environment_is_their_own(tmp_path, user_setting):
    """A preloaded module that asks torch.cuda.is_available() as it loads (torchtitan does)
    must not initialise the CUDA driver in the server: every forked worker's CUDA would be
    unusable. So the preload runs with PYTORCH_NVML_BASED_CUDA_CHECK=1, unless the user set
    it; the workers see only their own environment. (What NVML's check then does runs only
    on a GPU node.)"""
    (tmp_path / "nvml_probe.py").write_text(REPORT_NVML_CHECK)
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")])),
               REPORT_TO=str(tmp_path / "seen"))
    if user_setting is not None:
        env["PYTORCH_NVML_BASED_CUDA_CHECK"] = user_setting
    forks = ForkServer(["nvml_probe"], env, str(tmp_path / "server.log"))
    try:
        worker = forks.spawn([str(tmp_path / "nvml_probe.py")], env, str(tmp_path / "worker.log"))
        assert worker.wait(timeout=60) == 0, (tmp_path / "worker.log").read_text()
    finally:
        forks.close()
    preloaded = json.loads((tmp_path / "seen.nvml_probe").read_text())
    worker_saw = json.loads((tmp_path / "seen.__main__").read_text())
    assert (preloaded, worker_saw) == ((user_setting or "1"), user_setting)
