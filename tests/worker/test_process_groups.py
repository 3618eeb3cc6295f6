"""Process groups over real gloo groups: declared subgroups formed with the epoch's
group, gone with it, and formed again with the next one; late aborts; the
collective timeout; the connect timeout, and an abort that ends the rendezvous
of a member that died in it."""

import contextlib

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from peerstate import InvalidArgumentError  # noqa: E402
from peerstate.errors import AbortedError  # noqa: E402
from peerstate.control.kvstore import TorchKeyValueStore  # noqa: E402
from peerstate.worker.process_groups import ProcessGroups, Subgroup  # noqa: E402


@pytest.fixture
def groups(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    kv = TorchKeyValueStore("127.0.0.1", 0, host_store=True, timeout=10)
    groups = ProcessGroups("gloo")
    yield kv, groups
    groups.destroy()


def test_a_subgroup_is_formed_with_every_epoch(groups):
    kv, groups = groups
    declared = Subgroup([0], {})
    groups.add(declared, timeout=10)  # before the first epoch, as a spare declares it
    with pytest.raises(InvalidArgumentError, match=r"subgroup over ranks \[0\] is not formed"):
        declared.group
    for epoch in (0, 1):
        groups.form(kv, epoch, rank=0, world_size=1, timeout=10)
        total = torch.tensor([3])
        dist.all_reduce(total, group=declared.group)
        assert int(total) == 3
        groups.destroy()
        with pytest.raises(InvalidArgumentError, match="not formed"):
            declared.group


def test_a_subgroup_declared_in_a_formed_epoch_is_formed_at_once(groups):
    kv, groups = groups
    groups.form(kv, 0, rank=0, world_size=1, timeout=10)
    declared = Subgroup([0], {})
    groups.add(declared, timeout=10)
    assert declared.group is not None and dist.get_world_size(declared.group) == 1


def test_a_builders_meshes_are_formed_again_in_every_epoch_and_a_builder_that_changes_is_refused(groups):
    # torchtitan's shape: a world mesh, unflattened into named dimensions, two of them
    # flattened into one. The builder runs after peerstate's own groups in every epoch;
    # its groups are peerstate's (none undeclared), and the script keeps the first result.
    from torch.distributed.device_mesh import init_device_mesh

    from peerstate.worker.meshes import BuiltMeshes

    kv, groups = groups
    extra = []

    def build():
        world = init_device_mesh("cpu", (1,), mesh_dim_names=("world",))
        mesh = world._unflatten(0, (1, 1), ("dp_replicate", "dp_shard"))
        flat = mesh["dp_replicate", "dp_shard"]._flatten("dp")
        for ranks in extra:  # a builder that creates one more group than the first time
            dist.new_group(ranks)
        return {"mesh": mesh, "dp": flat}

    built = BuiltMeshes(build, layout=[("dp_replicate", 1), ("dp_shard", 1)])
    groups.add(built, timeout=10)
    first = None
    for epoch in (0, 1):
        groups.form(kv, epoch, rank=0, world_size=1, timeout=10)
        if first is None:
            first = built.value
        assert built.value is first and groups.describe_undeclared() is None
        total = torch.tensor([5])
        dist.all_reduce(total, group=first["dp"].get_group())  # the first mesh, on this epoch's group
        assert int(total) == 5
        groups.destroy()
    extra.append([0])
    with pytest.raises(Exception, match=r"builder created process groups named .* in this epoch, not"):
        groups.form(kv, 2, rank=0, world_size=1, timeout=10)


@contextlib.contextmanager
def _peer(kv, epoch, body, store="kv", prelude="", form_args=""):
    """A second process, rank 1 of a 2-rank gloo group of ``epoch`` formed through
    ``store`` (an expression; ``prelude`` may define it; ``form_args`` are more of
    form()'s arguments), that then runs ``body``; killed, if still running, when the
    block ends."""
    import subprocess
    import sys

    script = f"""
import os, sys, time, torch, torch.distributed as dist
from peerstate.control.kvstore import TorchKeyValueStore
from peerstate.worker.process_groups import ProcessGroups
kv = TorchKeyValueStore("127.0.0.1", int(sys.argv[1]), timeout=30)
kv.set("peer/imported", b"1")  # see _meet_late
{prelude}
groups = ProcessGroups("gloo")
groups.form({store}, {epoch}, rank=1, world_size=2, timeout=30{form_args})
{body}
"""
    peer = subprocess.Popen([sys.executable, "-c", script, str(kv.port)], stdout=subprocess.PIPE, text=True)
    try:
        yield peer
    finally:
        peer.kill()
        peer.wait()


def _meet_late(kv):
    """Wait until the peer has imported torch (seconds on a loaded machine): a group with
    a short connect timeout waits no longer than that for the peer's address."""
    kv.wait(["peer/imported"], timeout=120)


def test_an_abort_that_comes_after_its_epoch_formed_leaves_the_group_alone(groups):
    # The watcher thread of a worker can see a plan after the training loop has
    # already joined its epoch; the late abort must not shut down the new group.
    kv, groups = groups
    with _peer(kv, 1, """
for _ in range(2):
    total = torch.tensor([2])
    dist.all_reduce(total)
    print(int(total), flush=True)
groups.destroy()""") as peer:
        groups.form(kv, 1, rank=0, world_size=2, timeout=30)
        groups.abort(1)  # late: epoch 1's group is the one formed
        for _ in range(2):
            total = torch.tensor([1])
            dist.all_reduce(total)
            assert int(total) == 3
        assert peer.communicate(timeout=60)[0].split() == ["3", "3"]
        groups.abort(2)  # a newer epoch's abort still goes through
        with pytest.raises(RuntimeError):
            dist.all_reduce(torch.tensor([1]))


def test_the_members_of_a_node_form_their_groups_reading_the_rendezvous_once_through_its_channel(groups):
    # Both ranks on one node: what gloo reads in the rendezvous (the other rank's address),
    # for the default group and a declared one, comes through the node channel, and goes
    # from it once both ranks' groups are gone.
    from peerstate.control import keys

    kv, groups = groups
    channel = TorchKeyValueStore("127.0.0.1", 0, host_store=True, timeout=30)
    declared = Subgroup([0, 1], {})
    groups.add(declared, timeout=30)
    with _peer(kv, 2, """
declared = Subgroup([0, 1], {})
groups.add(declared, timeout=30)
total = torch.tensor([2])
dist.all_reduce(total, group=declared.group)
print(int(total), flush=True)
kv.wait(["test/looked"], timeout=60)
groups.destroy()""", prelude=f"""
from peerstate.worker.process_groups import Subgroup
channel = TorchKeyValueStore("127.0.0.1", {channel.port}, timeout=30)""", form_args=", channel=channel") as peer:
        groups.form(kv, 2, rank=0, world_size=2, timeout=30, channel=channel)
        total = torch.tensor([1])
        dist.all_reduce(total, group=declared.group)
        assert int(total) == 3
        assert peer.stdout.readline().strip() == "3"
        held = channel.torch_store.list_keys()
        kv.set("test/looked", b"1")
        peer.communicate(timeout=60)
        assert peer.returncode == 0
    claimed = {k[len(keys.rendezvous_claim("")):] for k in held if k.startswith(keys.rendezvous_claim(""))}
    shared = {k[len(keys.rendezvous_read("")):] for k in held if k.startswith(keys.rendezvous_read(""))} - \
        {keys.rendezvous_claim("")[len(keys.rendezvous_read("")):] + k for k in claimed}
    assert claimed and shared == claimed, held  # every read was made once for the node, and given to it
    assert len(shared) == 4, held  # both ranks' addresses in the default group and in the subgroup
    groups.destroy()  # the peer destroyed its own before it exited: the node's copies are gone
    assert channel.torch_store.list_keys() == []


def test_an_abort_ends_a_rendezvous_that_reads_through_the_node_channel(groups):
    import threading
    import time

    from peerstate.control import keys

    kv, groups = groups
    channel = TorchKeyValueStore("127.0.0.1", 0, host_store=True, timeout=30)
    outcome = []

    def form():  # its peer never comes
        try:
            groups.form(kv, 1, rank=0, world_size=2, timeout=60, channel=channel)
        except AbortedError as error:
            outcome.append(error)

    former = threading.Thread(target=form)
    former.start()
    peer_address = None  # gloo's key of rank 1's address: rank 0 claimed it, for the node, and waits for it
    deadline = time.monotonic() + 60
    while peer_address is None:
        claims = [k for k in channel.torch_store.list_keys() if k.startswith(keys.rendezvous_claim(""))]
        peer_address = next((k[len(keys.rendezvous_claim("")):] for k in claims if k.endswith("/1")), None)
        assert time.monotonic() < deadline and former.is_alive(), "the rendezvous read nothing through the channel"
        time.sleep(0.01)
    groups.abort(2)
    former.join(30)
    assert not former.is_alive() and outcome, "the abort did not end the rendezvous"
    assert channel.get(keys.rendezvous_read(peer_address)) is None  # it ended the read, not a peer


def test_gloo_collectives_time_out_after_the_collective_timeout(groups):
    # A gloo send that was being written when its peer died is woken by no abort
    # (see process_groups): the collective timeout is what ends it, long before
    # the rendezvous timeout (30 s here) and the Job's abort deadline.
    import time

    kv, _ = groups
    timed = ProcessGroups("gloo", collective_timeout=2.0)
    with _peer(kv, 0, """
print("formed", flush=True)
time.sleep(60)  # never enters the collective""") as peer:
        try:
            _meet_late(kv)
            timed.form(kv, 0, rank=0, world_size=2, timeout=30)
            assert peer.stdout.readline().strip() == "formed"
            started = time.monotonic()
            with pytest.raises(RuntimeError, match="[Tt]imed out"):
                dist.all_reduce(torch.ones(4))
            assert time.monotonic() - started < 15
        finally:
            timed.destroy()


@pytest.mark.e2e
def test_a_send_partly_written_when_its_peer_dies_waits_out_its_timeout_whatever_is_shut_down(groups):
    # Pins the gloo behaviour that collective_timeout and AFTER_ABORT_WAIT exist for.
    # gloo's tcp Pair::signalException wakes the pair's pending operations and the
    # bound buffers (op.buf) of its transmit queue, but not an unbound buffer's send in
    # that queue (op.ubuf): every torch collective and point-to-point send is one. A
    # send partly written (its peer stopped reading) when the peer dies then waits in
    # UnboundBuffer::waitSend for its timeout, though the abort shut its socket down.
    # If this fails, gloo wakes that send now, and the two timeouts can go.
    import os
    import signal
    import threading
    import time

    kv, _ = groups
    timed = ProcessGroups("gloo", collective_timeout=3.0)  # a send waits its gloo context's timeout: this one
    with _peer(kv, 0, """
buffer = torch.empty(16 << 20)
work = dist.irecv(buffer, src=0)
print("posted", flush=True)
os.kill(os.getpid(), 19)  # SIGSTOP: from now on it reads nothing""") as peer:
        try:
            _meet_late(kv)
            timed.form(kv, 0, rank=0, world_size=2, timeout=30)
            assert peer.stdout.readline().strip() == "posted"
            deadline = time.monotonic() + 10
            while open(f"/proc/{peer.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
                assert time.monotonic() < deadline, "the peer did not stop"
                time.sleep(0.01)
            time.sleep(0.2)  # its receive-ready notice is in: the send below goes out at once
            outcome = {}

            def send():
                try:
                    dist.send(torch.ones(16 << 20), dst=1)  # 64 MiB: far more than the socket buffers hold
                    outcome["sent"] = time.monotonic()
                except RuntimeError as error:
                    outcome["error"], outcome["at"] = str(error), time.monotonic()

            started = time.monotonic()
            sender = threading.Thread(target=send)
            sender.start()
            time.sleep(0.5)  # partly written, the rest in the pair's transmit queue
            os.kill(peer.pid, signal.SIGKILL)
            peer.wait()
            time.sleep(0.2)  # the pair has seen the reset
            timed.abort(1)  # 0.7 s into the send
            sender.join(30)
            assert "error" in outcome, outcome
            assert "send operation to complete" in outcome["error"], outcome["error"]
            assert outcome["at"] - started > 2.8, ("the send was woken by the abort: gloo fixed Pair::signalException, "
                                                   "collective_timeout and AFTER_ABORT_WAIT are no longer needed")
        finally:
            timed.destroy()


def _loopback_bytes() -> int:
    with open("/proc/net/dev") as counters:
        for line in counters:
            if line.strip().startswith("lo:"):
                return int(line.split(":")[1].split()[0])
    raise AssertionError("no loopback counters")


@pytest.mark.e2e
def test_a_receive_part_read_when_its_peer_dies_waits_out_its_timeout_whatever_is_shut_down(groups):
    # Pins the receiving side of the same gloo behaviour, met in the soak (a node lost
    # while a survivor's DDP bucket arrived from it: 30 s). A pair reading a message
    # holds the receive it reads into apart from its pending ones (rx_.ubuf), and
    # Pair::signalException, on the peer's end of stream, wakes only the pending ones:
    # the receive part read waits in UnboundBuffer::waitRecv for its timeout, though
    # the pair failed and the abort shut its socket down. DDP's reductions are ended
    # by failing the futures DDP waits on instead (rebuild.PendingReductions). If this
    # fails, gloo wakes that receive now.
    import os
    import signal
    import threading
    import time

    kv, _ = groups
    timed = ProcessGroups("gloo", collective_timeout=6.0)  # a receive waits its gloo context's timeout: this
    with _peer(kv, 0, """
print("sending", flush=True)
dist.send(torch.ones(64 << 20), dst=0)  # 256 MiB""") as peer:
        try:
            _meet_late(kv)
            timed.form(kv, 0, rank=0, world_size=2, timeout=30)
            outcome = {}

            def receive():
                try:
                    dist.recv(torch.empty(64 << 20), src=1)
                    outcome["received"] = time.monotonic()
                except RuntimeError as error:
                    outcome["error"], outcome["at"] = str(error), time.monotonic()

            receiver = threading.Thread(target=receive)
            before = _loopback_bytes()
            started = time.monotonic()  # gloo counts the receive's timeout from here
            receiver.start()
            assert peer.stdout.readline().strip() == "sending"
            deadline = time.monotonic() + 20
            while _loopback_bytes() - before < 32 << 20:  # an eighth of the message in
                assert time.monotonic() < deadline, "the message did not start"
                time.sleep(0.0005)
            os.kill(peer.pid, signal.SIGKILL)  # its end of stream comes after what it wrote
            killed = time.monotonic()
            peer.wait()
            time.sleep(0.2)  # the pair has read the end of stream
            timed.abort(1)
            aborted = time.monotonic()
            receiver.join(30)
            assert "error" in outcome, f"the whole message arrived before the kill: {outcome}"
            assert "recv operation to complete" in outcome["error"], outcome["error"]
            assert killed < aborted < outcome["at"], "the receive ended before the abort: nothing was shown"
            assert outcome["at"] - started > 5.5, "the receive was woken: gloo fixed Pair::signalException"
        finally:
            timed.destroy()


# Rank 1 of the group: forms through a store that, once gloo has published this
# process's address, exits, before it connects anything. The address it publishes
# says 127.0.0.2: gloo lets the side with the larger address connect, so rank 0
# (127.0.0.1) is the side that waits to be connected to, the wait no abort ends.
_DIES_IN_THE_RENDEZVOUS = """
class DiesOncePublished(dist.Store):
    def __init__(self, store):
        super().__init__()
        self.store = store
    def rendezvous_store(self):  # what form() asks a KeyValueStore for
        self.clones = getattr(self, "clones", []) + [DiesOncePublished(self.store.clone())]  # kept alive
        return self.clones[-1]
    def set(self, key, value):
        self.store.set(key, value.replace(bytes([127, 0, 0, 1]), bytes([127, 0, 0, 2]), 1))
        os._exit(0)
    def get(self, key):
        return self.store.get(key)
    def wait(self, keys, timeout=None):
        return self.store.wait(keys) if timeout is None else self.store.wait(keys, timeout)
    def check(self, keys):
        return self.store.check(keys)
    def add(self, key, amount):
        return self.store.add(key, amount)
    def compare_set(self, key, expected, desired):
        return self.store.compare_set(key, expected, desired)
    def delete_key(self, key):
        return self.store.delete_key(key)
    def num_keys(self):
        return self.store.num_keys()
dying = DiesOncePublished(kv.torch_store)
"""

# In a Job the members reach form() together (every member reported): here the
# peer, which starts seconds later, waits for the test at a barrier first.
_BARRIER = 'kv.set("ready", b""); kv.wait(["go"], timeout=60)'


def _meet(kv):
    kv.wait(["ready"], timeout=60)
    kv.set("go", b"")


def test_an_abort_ends_the_wait_for_a_member_that_died_in_the_rendezvous(groups):
    # Seen in test_recovery's second-failure test, then in the soak: rank 1 died while
    # the group of a recovery formed, and the others waited for its connection for five
    # times the connect timeout (gloo's connect wait, no socket to shut down) after the
    # next epoch had begun. The abort now makes that connection itself.
    import threading
    import time

    kv, _ = groups
    # Without the abort's connection the wait ends only when the formation watch gives up
    # (30 s here, which the assertion below tells apart), or after five group timeouts.
    forming = ProcessGroups("gloo", connect_timeout=30.0)
    aborted = []
    with _peer(kv, 1, "raise SystemExit('not reached: the store exits first')", store="dying",
               prelude=_DIES_IN_THE_RENDEZVOUS + _BARRIER) as peer:

        def abort_once_the_peer_is_gone():
            peer.wait(timeout=60)
            time.sleep(0.2)  # rank 0 is in its connect wait by now
            aborted.append(time.monotonic())
            forming.abort(2)

        watcher = threading.Thread(target=abort_once_the_peer_is_gone)
        watcher.start()
        try:
            _meet(kv)
            with pytest.raises(AbortedError, match="epoch 2 began while the group of epoch 1 formed"):
                forming.form(kv, 1, rank=0, world_size=2, timeout=60)
            assert peer.returncode == 0  # it did publish, and exited in the store
            assert time.monotonic() - aborted[0] < 10.0  # ended before one connect timeout, not after five
        finally:
            peer.kill()  # before the join: the watcher waits for it
            watcher.join()
            forming.destroy()


@pytest.mark.e2e
def test_a_group_created_under_the_connect_timeout_waits_its_full_timeout_in_collectives(groups):
    kv, _ = groups
    forming = ProcessGroups("gloo", connect_timeout=1.0)
    with _peer(kv, 1, """
time.sleep(4)  # four connect timeouts late for the collective
total = torch.tensor([2])
dist.all_reduce(total)
print(int(total), flush=True)""", prelude=_BARRIER) as peer:
        try:
            _meet(kv)
            forming.form(kv, 1, rank=0, world_size=2, timeout=30)
            total = torch.tensor([1])
            dist.all_reduce(total)
            assert int(total) == 3
            assert peer.communicate(timeout=60)[0].strip() == "3"
        finally:
            forming.destroy()



# How the members below end: as a job's workers do (fork_server_process._end_as_forked_child),
# with os._exit once their output is flushed, not through the interpreter's finalisation.
# A group still referenced from Python (a mesh's) outlives destroy(), and its gloo thread may
# release the last collective's tensors only after finalisation began: it then takes the GIL,
# is ended by the interpreter inside a noexcept destructor, and the process aborts with
# "terminate called without an active exception" (pytorch#190489; 1 run in 5 here, unloaded).
_END_AS_A_WORKER = "import os\nsys.stdout.flush()\nsys.stderr.flush()\nos._exit(0)\n"

# Both ranks of the test below: the default group, a declared subgroup and a declared
# mesh's group, each formed by form() under a connect timeout far shorter than the wait.
_PIPELINE_MEMBER = """
import sys, time, torch, torch.distributed as dist
from peerstate.control.kvstore import TorchKeyValueStore
from peerstate.worker.meshes import DeclaredMesh
from peerstate.worker.process_groups import ProcessGroups, Subgroup
rank, kv = int(sys.argv[2]), TorchKeyValueStore("127.0.0.1", int(sys.argv[1]), timeout=60)
groups = ProcessGroups("gloo", collective_timeout=30.0, connect_timeout=0.3)
subgroup, mesh = Subgroup([0, 1], {}), DeclaredMesh("cpu", (2,), ("pp",))
groups.add(subgroup, timeout=30)
groups.add(mesh, timeout=30)
kv.add("ready", 1)
kv.wait(["go"], timeout=120)
groups.form(kv, 1, rank=rank, world_size=2, timeout=60)
for name, group in (("default", None), ("subgroup", subgroup.group), ("mesh", mesh.get_group("pp"))):
    if rank == 1:
        time.sleep(1.5)  # five connect timeouts late: a pipeline stage still computing
        got = torch.zeros(4)
        dist.recv(got, src=0, group=group)
        print(name, int(got.sum()), flush=True)
    else:
        dist.send(torch.ones(4), dst=1, group=group)  # waits for the receiver
groups.destroy()
""" + _END_AS_A_WORKER


@pytest.mark.e2e
def test_point_to_point_waits_last_the_collective_timeout_not_the_connect_timeout(groups):
    # gloo's sends and receives wait for the timeout their group was created under, and
    # set_timeout does not reach them: a group formed under a recovery's 0.5 s connect
    # timeout failed every pipeline send whose receiver came later than that (torchtitan's
    # pipeline, the step after a recovery: "Timed out waiting 500ms for send").
    import subprocess
    import sys
    import time

    kv, _ = groups
    members = [subprocess.Popen([sys.executable, "-c", _PIPELINE_MEMBER, str(kv.port), str(rank)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        deadline = time.monotonic() + 120
        while int(kv.add("ready", 0)) < 2:  # both imported torch: they reach form() together
            assert all(m.poll() is None for m in members), [m.communicate() for m in members]
            assert time.monotonic() < deadline, "the members did not start"
            time.sleep(0.05)
        kv.set("go", b"")
        outputs = [m.communicate(timeout=120) for m in members]
        assert [m.returncode for m in members] == [0, 0], outputs
        assert outputs[1][0].split("\n")[:3] == ["default 4", "subgroup 4", "mesh 4"], outputs
    finally:
        for member in members:
            member.kill()
            member.wait()

_MESH_MEMBER = """
import sys, torch, torch.distributed as dist
from peerstate.control.kvstore import TorchKeyValueStore
from peerstate.worker.meshes import DeclaredMesh
from peerstate.worker.process_groups import ProcessGroups
port, rank = int(sys.argv[1]), int(sys.argv[2])
kv = TorchKeyValueStore("127.0.0.1", port, timeout=60)
groups = ProcessGroups("gloo")
groups.form(kv, 0, rank=rank, world_size=2, timeout=60)
declared = DeclaredMesh("cpu", (2, 1), ("replicate", "shard"))
groups.add(declared, timeout=60)
names, mesh = declared.mesh._dim_group_names, declared.mesh
groups.destroy()
groups.form(kv, 1, rank=rank, world_size=2, timeout=60)
assert declared.mesh is mesh and declared.mesh._dim_group_names == names
total = torch.tensor([rank + 1])
dist.all_reduce(total, group=declared.get_group("replicate"))
alone = torch.tensor([rank + 1])
dist.all_reduce(alone, group=declared.get_group("shard"))
print(names, int(total), int(alone), flush=True)
groups.destroy()
""" + _END_AS_A_WORKER

_STORE = """
import sys
from peerstate.control.kvstore import TorchKeyValueStore
kv = TorchKeyValueStore("127.0.0.1", 0, host_store=True, timeout=60)
print(kv.port, flush=True)
sys.stdin.read()  # until the test closes it
"""


def test_a_declared_mesh_keeps_its_object_and_group_names_across_epochs(monkeypatch):
    # The mesh (and what FSDP2, DTensors and TP plans built on it) finds groups by name:
    # the re-formed epoch's groups must come out under the old names, in the same object.
    # The store and both members are processes of their own, as in a job: the pytest
    # process carries what hundreds of earlier tests left in it (threads, descriptors).
    import subprocess
    import sys

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    store = subprocess.Popen([sys.executable, "-c", _STORE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    members = []
    try:
        port = store.stdout.readline().strip()
        assert port.isdigit(), store.communicate(timeout=60)
        members = [subprocess.Popen([sys.executable, "-c", _MESH_MEMBER, port, str(rank)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
        outputs = [member.communicate(timeout=240) for member in members]
        assert [member.returncode for member in members] == [0, 0], outputs
    finally:
        for process in members + [store]:
            process.kill()
            process.wait()
    for rank, (out, _) in enumerate(outputs):
        names, total, alone = out.strip().rsplit(" ", 2)
        # "replicate" spans both ranks; "shard" is each rank alone
        assert (int(total), int(alone)) == (3, rank + 1), out
        assert len(eval(names)) == 2


def test_a_group_created_outside_peerstate_is_found(groups):
    kv, groups = groups
    groups.form(kv, 0, rank=0, world_size=1, timeout=10)
    assert groups.undeclared() == []
    groups.add(Subgroup([0], {}), timeout=10)
    assert groups.undeclared() == []
    direct = dist.new_group([0])
    assert groups.undeclared() == [direct]
    assert groups.describe_undeclared().startswith("process groups were created outside peerstate: ranks [0]. ")
    groups.destroy()
    groups.form(kv, 1, rank=0, world_size=1, timeout=10)
    assert groups.undeclared() == []


def test_the_default_group_is_peerstates(groups):
    from peerstate.worker.process_groups import claim_default_group, release_default_group

    kv, groups = groups
    groups.form(kv, 0, rank=0, world_size=1, timeout=10)  # as if the script had formed it
    with pytest.raises(InvalidArgumentError, match=r"initialised before peerstate.Job\(\): remove the script's"):
        claim_default_group(InvalidArgumentError)
    groups.destroy()
    original = dist.init_process_group
    claim_default_group(InvalidArgumentError)
    try:
        with pytest.raises(InvalidArgumentError, match=r"called after peerstate.Job\(\).*Job\(backend=\.\.\.\)"):
            dist.init_process_group("gloo", store=kv.torch_store, rank=0, world_size=1)
        groups.form(kv, 1, rank=0, world_size=1, timeout=10)  # peerstate's own still forms
        assert dist.is_initialized()
    finally:
        release_default_group()
    assert dist.init_process_group is original


def test_after_an_abort_a_gloo_wait_gives_up_within_a_second(groups):
    # A loop may wait on collectives one after the other, and a send no abort wakes waits
    # out its timeout: after an abort, each later collective's wait must be short, or they
    # add up past the abort deadline (seen: a 1F1B stage exited at the deadline, holding
    # the only replica of the rank that was killed).
    import datetime

    from peerstate.worker.process_groups import AFTER_ABORT_WAIT

    kv, groups = groups
    groups.collective_timeout = 30.0
    groups.form(kv, 0, rank=0, world_size=1, timeout=10)
    declared = Subgroup([0], {})
    groups.add(declared, timeout=10)
    backends = [g._get_backend(torch.device("cpu")) for g in (dist.distributed_c10d._get_default_group(),
                                                            declared.group)]
    assert [b.options._timeout for b in backends] == [datetime.timedelta(seconds=30)] * 2
    groups.abort(1)
    assert [b.options._timeout for b in backends] == [datetime.timedelta(seconds=AFTER_ABORT_WAIT)] * 2


def test_a_subgroup_declared_after_its_epoch_formed_through_etcd_forms_too(tmp_path, monkeypatch):
    # etcd's rendezvous store is implemented in Python: torch holds it by its C++ half only,
    # which cannot call Python once nothing holds the Python object (then torch's "Not
    # implemented" from its Python-store trampoline). The groups keep the epoch's store.
    import gc

    from helpers.etcd import EtcdCluster

    from peerstate.control.etcd_store import EtcdKeyValueStore

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    cluster = EtcdCluster(tmp_path)
    groups = ProcessGroups("gloo")
    try:
        kv = EtcdKeyValueStore(cluster.endpoints, "/peerstate/late-subgroup/")
        groups.form(kv, 0, rank=0, world_size=1, timeout=20)
        gc.collect()
        declared = Subgroup([0], {})
        groups.add(declared, timeout=20)
        total = torch.tensor([4])
        dist.all_reduce(total, group=declared.group)
        assert int(total) == 4
    finally:
        groups.destroy()
        cluster.close()
