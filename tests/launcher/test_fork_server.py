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
    print("buffered, never flushed by the script", end="")
    what = sys.argv[1]
    if what == "message":
        sys.exit("the script's own message")
    if what == "code":
        sys.exit(3)
""")


@pytest.mark.parametrize("how, code", [("code", 3), ("message", 1), ("end", 0)])
def test_a_forked_worker_ends_as_its_interpreter_would(tmp_path, server, how, code):
    # It skips the interpreter's teardown of what the server preloaded, and nothing else:
    # its non-daemon threads finish, its atexit functions run (after them, as in
    # Py_Finalize), its buffered output is flushed, its exit status is the script's.
    script, marks, log = tmp_path / "ending.py", tmp_path / "marks.txt", tmp_path / "ending.log"
    script.write_text(ENDINGS)
    assert server.spawn([str(script), how, str(marks)], dict(os.environ), str(log)).wait(timeout=60) == code
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


def test_a_preload_that_fails_says_which_and_how_to_do_without(tmp_path):
    forks = ForkServer(["peerstate_no_such_module"], dict(os.environ), str(tmp_path / "server.log"))
    try:
        with pytest.raises(JobFailedError, match="peerstate_no_such_module.*--preload ''"):
            forks.spawn([str(tmp_path / "worker.py")], dict(os.environ), str(tmp_path / "worker.log"))
    finally:
        forks.close()
    assert forks._popen.poll() is not None


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
