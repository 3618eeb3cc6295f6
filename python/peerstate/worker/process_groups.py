"""The training's process groups, formed per epoch and abortable from any thread.

Forming: ``torch.distributed.init_process_group`` over the job's TCPStore under
the prefix ``keys.process_group_prefix(epoch)``, so a re-formed group never reads the keys of the
group it replaces (what it reads, each node reads once: ``control.node_rendezvous``);
then every declared ``Subgroup`` (``Job.new_group``, with ``torch.distributed.new_group``)
and ``DeclaredMesh`` (``Job.device_mesh``, see ``meshes``), in declaration order.
Every epoch creates the same groups in the same order, so they get the same names,
which is what a ``DeviceMesh`` finds them by.

Aborting, so that a training loop blocked in a collective fails at once:
- NCCL: ``ProcessGroup.abort()`` (``ncclCommAbort``) of every group, inside
  one NCCL group call as torch's own abort-all does (separate aborts can
  deadlock each other: pytorch#119797).
- gloo: ``abort()`` exists but does not wake a collective already blocked on a
  peer (torch 2.13: the call returns and the collective still waits for its
  timeout). What does work is ``shutdown(2)`` on the group's connected sockets:
  the blocked read fails at once with "Connection closed by peer", here and on
  the peers at the other end. The sockets are the ones ``init_process_group``
  opened (gloo connects its full mesh eagerly); they are recognised by inode,
  so a reused descriptor number is never touched, and listening sockets are
  left alone (gloo treats a failed accept() as fatal). The sockets of declared
  subgroups and meshes are collected the same way as they form. Groups
  created with ``torch.distributed.new_group`` or ``init_device_mesh``
  directly are not known here, so not aborted: ``undeclared()`` finds them,
  and ``Job.guard`` refuses to run a step while one exists.
- A rendezvous in progress (a member died after it reported): the group is
  formed through its own store connection, whose socket is shut down the
  same way, so ``init_process_group`` fails at once instead of waiting out the
  store's timeout.

One gloo rendezvous step no socket shutdown can wake: a member that published its
address and died before connecting. gloo picks one side of each pair to
connect (by address order); the other waits for it in
``Pair::waitUntilConnected`` for five times the group's timeout, and there is
no socket yet to shut down. What the waiting side waits for is a connection to
its own listener that writes the sequence number the pair expects: the
connecting peer's rank in the group (gloo's ``GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER``
contract; without it, the pair's index in a listener created for that group,
the same number). So an abort during a rendezvous connects to each listener
the rendezvous opened and writes every rank's number, then closes: each wait
for a dead peer ends with a pair whose peer hung up, and the rendezvous fails
or forms a group that form() then refuses (AbortedError). Pairs already
connected keep theirs: gloo parks a connection nobody waits for until the
group's teardown. Listeners are recognised by inode, as the connected sockets
are: sockets opened since form() began that accept connections.
When no abort comes (a member that is late rather than dead), the connect
timeout is the bound: form() gives a rendezvous up when it completes no group
for that long (``gloo_rendezvous.FormationWatch``, which ends its waits the
way an abort does). The group's own timeout cannot be that bound: gloo keeps
the timeout a group is created under as its context's, which every
point-to-point wait uses (a pipeline's sends and receives; ``set_timeout``
reaches only the collectives), so a group created under a short connect
timeout failed every pipeline send that waited longer than that for its
peer (torchtitan's pipeline after a recovery: 0.5 s). A gloo group is
therefore created under its collective wait. A short bound is safe because
form() is only called when every member has reported for the epoch
(``Job``'s join is a barrier): the members reach it together, and forming
takes milliseconds; one that comes late makes the others regroup
(``EpochJoiner._form``, which also picks the connect timeout).

Two gloo operations no socket shutdown can wake. The receiving one: a
receive part way through a message when its peer dies. The pair reading it
holds it apart from its pending receives, and ``Pair::signalException`` wakes
only those; the receive waits in ``UnboundBuffer::waitRecv`` for its timeout
(seen in the soak: a node lost while a survivor's DDP bucket arrived from it).
DDP's reductions are ended by failing the futures DDP waits on instead
(``rebuild.PendingReductions``); other calls wait for the collective timeout
below. The sending one: a send still being written when its
peer dies. gloo's tcp transport keeps a partly written send in the pair's
transmit queue. A write that meets EPIPE or ECONNRESET is not an error there,
and when the pair then fails on a read, ``Pair::signalException`` wakes the
pair's pending sends and receives but not the sends in that queue. The
collective waits in ``UnboundBuffer::waitSend`` for its timeout, whatever is
shut down (seen in the demo after a node loss: a ring allreduce's send to a
killed rank). So gloo groups get ``collective_timeout``, shorter than the
Job's abort deadline: such a collective fails on its own, and its rank
recovers with its state, instead of exiting at the deadline. A collective
reads its group's timeout when it starts, so an abort also sets every group's
to ``AFTER_ABORT_WAIT``: a loop that then runs more collectives in turn, each
possibly stuck the same way, gives up on each within a second instead of
adding their timeouts up past the deadline. A point-to-point wait reads its
group's gloo context timeout, which nothing changes once the group is formed
(the collective timeout, see above): a pipeline schedule's send stuck that way
waits it out, and the operations it starts after the abort, on pairs whose
sockets were shut down, fail at once.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Union

from peerstate.control import keys
from peerstate.control.environment import SCRIPT_DEFAULT_GROUP
from peerstate.control.node_rendezvous import node_rendezvous_store
from peerstate.control.sockets import shutdown, socket_inodes
from peerstate.errors import AbortedError, InvalidArgumentError
from peerstate.errors import TimeoutError as PeerstateTimeoutError
from peerstate.worker.gloo_rendezvous import FormationWatch, end_connect_waits
from peerstate.worker.meshes import DeclaredMesh
from peerstate.worker import torch_private

AFTER_ABORT_WAIT = 1.0  # seconds a gloo wait that starts after an abort may take (ProcessGroups.abort)


class _TimeoutCalls(threading.local):
    depth = 0


_passing = _TimeoutCalls()


@contextlib.contextmanager
def passing_timeout_calls() -> Iterator[None]:
    """Within it, the calling thread's timeout calls go to torch as they are
    (``script_timeouts`` keeps only the script's own): peerstate's own setting of a
    wait, and torch's calls nested in a script's call that was already kept once
    (torch 2.14's ``_set_pg_timeout`` calls ``set_timeout``, which calls the group's
    method). Nests."""
    _passing.depth += 1
    try:
        yield
    finally:
        _passing.depth -= 1


def timeout_calls_pass() -> bool:
    """Whether the calling thread is inside ``passing_timeout_calls``."""
    return _passing.depth > 0


class Subgroup:
    """A process group over some of the ranks that peerstate aborts with the
    default group on a failure and forms again in every epoch (``Job.new_group``)."""

    def __init__(self, ranks: Sequence[int], options: Dict[str, Any]) -> None:
        self.ranks = list(ranks)
        self.options = options
        self._group: Any = None

    @classmethod
    def declared(cls, ranks: Sequence[int], options: Dict[str, Any], world_size: int) -> "Subgroup":
        """``Job.new_group``'s arguments, checked against the world size."""
        ranks = list(ranks)
        if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < world_size for r in ranks):
            raise InvalidArgumentError(f"new_group() needs distinct ranks in [0, {world_size}), got {ranks}")
        return cls(ranks, options)

    def dissolve(self) -> None:
        self._group = None

    @property
    def group(self) -> Any:
        """The current epoch's ``ProcessGroup`` (torch's non-member marker on a rank
        outside ``ranks``). Read it at each use: a recovery replaces it."""
        if self._group is None:
            raise InvalidArgumentError(
                f"the subgroup over ranks {self.ranks} is not formed: this process has no rank yet (a spare "
                "waiting in track()) or its epoch's groups are being re-formed")
        return self._group


class ProcessGroups:
    """The default process group of the current epoch, and the declared subgroups and meshes."""

    def __init__(self, backend: str, collective_timeout: Optional[float] = None,
                 connect_timeout: Optional[float] = None) -> None:
        """gloo only (NCCL ignores both):

        ``collective_timeout``: seconds a collective may wait; declared subgroups whose
        options set their own timeout keep it. None: the ``timeout`` given to form().

        ``connect_timeout``: form() gives a rendezvous up when it completes no group for
        this long. Only for members that reach form() together (see the module
        docstring). None: gloo's own wait bounds it (the group's timeout, five times
        that for a peer that was to connect)."""
        self.backend = backend
        self.default_collective_timeout = collective_timeout
        self.collective_timeout = collective_timeout  # this epoch's: a regroup's plan raises it
        self.connect_timeout = connect_timeout
        self.epoch: Optional[int] = None
        self._declared: List[Union[Subgroup, DeclaredMesh]] = []
        self._formed: Set[Any] = set()      # the ProcessGroup objects formed here this epoch
        self._sockets: Set[str] = set()
        self._forming: Set[str] = set()   # the rendezvous connection while form() runs
        self._forming_since: Optional[Set[str]] = None  # the sockets open before form() began, while it runs
        self._forming_size, self._forming_epoch = 0, -1
        # The epoch's rendezvous store, until destroy() (an abort interrupts it while form() runs):
        # torch holds a store implemented in Python only by its C++ half, which cannot call Python
        # once nothing holds the Python object.
        self._store: Any = None
        self._abort_epoch = -1             # the newest epoch that asked for an abort
        self._waits: Dict[str, float] = {}  # gloo: the wait this object gave each group, by group name
        self._asked: Dict[str, float] = {}  # the waits the script set itself (script_timeout), by group name
        self._lock = threading.Lock()

    def form(self, kv, epoch: int, rank: int, world_size: int, timeout: float,
             connect_timeout: Optional[float] = None, channel=None) -> None:
        """Join the epoch's group, then form the declared subgroups and meshes, through the
        job's store ``kv`` (a KeyValueStore; blocks until every rank joins, ``timeout``,
        or an abort for a newer epoch: then AbortedError). What the rendezvous reads,
        each node reads once, shared through its node channel ``channel``
        (``control.node_rendezvous``). With gloo, a rendezvous that
        completes no group for the connect timeout (``connect_timeout``, or the one
        this object was made with) is given up: PeerstateTimeoutError."""
        import torch.distributed as dist

        self.destroy()
        before = socket_inodes()
        rendezvous = kv.rendezvous_store()
        if channel is not None:
            rendezvous = node_rendezvous_store(rendezvous, channel.clone(), timeout)
        with self._lock:
            if self._abort_epoch > epoch:
                raise AbortedError(f"epoch {self._abort_epoch} began before the group of epoch {epoch} formed")
            self._forming = socket_inodes() - before  # a TCPStore clone's connection, shut by an abort
            self._store = rendezvous                   # an etcd one is interrupted instead
            self._forming_since, self._forming_size, self._forming_epoch = before, world_size, epoch
        # torch names the default group after a per-process counter, reset only when a
        # formed group is destroyed: a rendezvous aborted part way leaves it counted up,
        # and this rank would then wait under another name than a fresh spare's.
        torch_private.reset_group_naming()
        connect = connect_timeout or self.connect_timeout
        # A gloo group keeps the timeout it is created under for its point-to-point waits
        # (a pipeline's sends: set_timeout reaches only the collectives), so it is created
        # under its collective wait, and the watch bounds the rendezvous instead.
        wait = self.collective_timeout or timeout
        gloo = self.backend == "gloo"
        watch = FormationWatch(connect if gloo else None, lambda: len(torch_private.group_names()),
                               lambda: self._give_up_forming(epoch))
        try:
            with watch:
                prefixed = dist.PrefixStore(keys.process_group_prefix(epoch), rendezvous)
                dist.distributed_c10d.init_process_group(  # not dist.init_process_group: see claim_default_group
                    self.backend, store=prefixed, rank=rank, world_size=world_size,
                    timeout=datetime.timedelta(seconds=wait if gloo else timeout))
                self._set_wait(torch_private.default_group(), wait)
                for declared in self._declared:
                    self._form_declared(declared, timeout)
        except Exception as error:  # noqa: BLE001 - torch raises several types for a missed rendezvous
            self._end_forming(epoch)
            if watch.gave_up:
                raise self._gave_up_error(epoch, connect) from None
            raise PeerstateTimeoutError(
                f"forming the process group of epoch {epoch} failed within {timeout:.0f}s: {error}") from None
        self._end_forming(epoch)
        if watch.gave_up:  # its waits were ended by hand: a pair may be to a peer that hung up
            raise self._gave_up_error(epoch, connect)
        with self._lock:
            self.epoch = epoch
            self._sockets = socket_inodes() - before if gloo else set()
            self._formed = set(torch_private.group_names())

    def _end_forming(self, epoch: int) -> None:
        """form() is over: AbortedError if a newer epoch's abort came while it ran."""
        with self._lock:
            self._forming, self._forming_since = set(), None
            if self._abort_epoch > epoch:
                raise AbortedError(f"epoch {self._abort_epoch} began while the group of epoch {epoch} formed")

    @staticmethod
    def _gave_up_error(epoch: int, connect: float) -> PeerstateTimeoutError:
        return PeerstateTimeoutError(f"forming the process group of epoch {epoch} failed: no group of it formed "
                                     f"for {connect:g}s (the connect timeout): a member is late or lost")

    def _give_up_forming(self, epoch: int) -> None:
        """The formation watch's call: end the rendezvous of ``epoch`` if it still runs."""
        with self._lock:
            if self._forming_since is not None and self._forming_epoch == epoch:
                self._end_rendezvous()

    def _end_rendezvous(self) -> None:
        """Make the rendezvous form() runs fail now (under the lock): its store connection
        shut or interrupted, and gloo's waits for a peer to connect ended. Nothing while
        form() does not run."""
        if self._forming_since is None:
            return
        if self._forming:
            shutdown(self._forming)
        if self.backend == "gloo":
            end_connect_waits(self._forming_since, self._forming_size)
        if hasattr(self._store, "interrupt"):
            self._store.interrupt()

    def add(self, declared: Union[Subgroup, DeclaredMesh], timeout: float) -> None:
        """Declare a subgroup or a mesh: formed now if this epoch's group is, and in
        every form()."""
        self._declared.append(declared)
        if self.epoch is None:
            return  # a spare: formed with its first epoch
        before = socket_inodes()
        self._form_declared(declared, timeout)  # the ranks call add() at their own pace
        with self._lock:
            if self.backend == "gloo":
                self._sockets |= socket_inodes() - before
            self._formed = set(torch_private.group_names())

    def formed(self) -> List[Any]:
        """The process groups formed here this epoch (the default group, declared ones)."""
        with self._lock:
            return list(self._formed)

    def undeclared(self) -> List[Any]:
        """Process groups of this process that peerstate did not form (created with
        ``torch.distributed.new_group`` or ``init_device_mesh`` directly): no abort
        reaches them and no recovery re-forms them."""
        if self.epoch is None:
            return []
        return [group for group in torch_private.group_names() if group not in self._formed]

    def describe_undeclared(self) -> Optional[str]:
        """What is wrong when ``undeclared()`` finds groups (None when it finds none)."""
        import torch.distributed as dist

        undeclared = self.undeclared()
        if not undeclared:
            return None
        described = ", ".join(f"ranks {dist.get_process_group_ranks(group)}"
                              + (f" ({group.group_desc})" if group.group_desc != "undefined" else "")
                              for group in undeclared)
        return (f"process groups were created outside peerstate: {described}. No abort reaches their collectives "
                "when a rank fails, and no recovery re-forms them. Create them with job.new_group(ranks) or "
                "job.device_mesh(...) before track() instead of torch.distributed.new_group or init_device_mesh.")

    def _form_declared(self, declared: Union[Subgroup, DeclaredMesh], timeout: float) -> None:
        if isinstance(declared, Subgroup):
            self._form_subgroup(declared, timeout)
            return
        wait = self.collective_timeout or timeout
        declared.form(wait if self.backend == "gloo" else None, lambda group: self._set_wait(group, wait))

    def _form_subgroup(self, subgroup: Subgroup, timeout: float) -> None:
        """Create ``subgroup``; its gloo collectives wait for the subgroup's own timeout,
        else ``collective_timeout``, else ``timeout`` (and it is created under that)."""
        import torch.distributed as dist

        own = subgroup.options.get("timeout")
        if self.backend == "gloo":
            wait = own.total_seconds() if own is not None else self.collective_timeout or timeout
            subgroup._group = dist.new_group(subgroup.ranks, **{**subgroup.options,
                                                                "timeout": datetime.timedelta(seconds=wait)})
            if torch_private.is_member(subgroup._group):
                self._set_wait(subgroup._group, wait)
        else:
            subgroup._group = dist.new_group(subgroup.ranks,
                                             **{"timeout": datetime.timedelta(seconds=timeout), **subgroup.options})

    def _set_wait(self, group: Any, seconds: float) -> None:
        """How long ``group``'s gloo collectives wait (see the module docstring), or
        less where the script asked for less (``script_timeout``)."""
        if self.backend == "gloo":

            name = torch_private.group_names().get(group)
            if name is not None:
                self._waits[name] = seconds
            with passing_timeout_calls():
                torch_private.set_group_timeout(
                    group, datetime.timedelta(seconds=min(seconds, self._asked.get(name, seconds))))

    def script_timeout(self, group: Any, seconds: float) -> float:
        """The timeout ``group`` gets when the script sets it to ``seconds`` after
        ``Job()``: at most the wait this object gave it (a gloo group peerstate formed:
        a longer wait could hold the loop past the abort deadline), and kept through
        every re-formation of the group, so a shorter one lasts. Any other group (NCCL,
        whose abort ends a collective whatever its timeout; a group not formed here)
        gets ``seconds``."""
        name = torch_private.group_names().get(group)
        if name not in self._waits:
            return seconds
        self._asked[name] = seconds
        return min(seconds, self._waits[name])

    def abort(self, new_epoch: int) -> None:
        """Make every collective of these groups, or their rendezvous, fail now because
        ``new_epoch`` began (thread-safe, idempotent, never blocks long). An abort that
        comes after the group of ``new_epoch`` (or a later one) formed does nothing: the
        group it was meant for is gone already."""
        with self._lock:
            if self.epoch is not None and self.epoch >= new_epoch:
                return
            self._abort_epoch = max(self._abort_epoch, new_epoch)
            if self._forming_since is None or new_epoch > self._forming_epoch:
                self._end_rendezvous()
            if self.epoch is None:
                return
            if self.backend == "gloo":
                shutdown(self._sockets)
                self._fail_later_waits()
                return
        with torch_private.one_nccl_call() as groups:
            for group in groups:
                try:
                    group.abort()
                except Exception:  # noqa: BLE001 - already destroyed or aborted
                    pass

    def _fail_later_waits(self) -> None:
        """After an abort, every collective that starts on these gloo groups gives up
        within ``AFTER_ABORT_WAIT`` seconds: a collective reads its group's timeout when
        it starts, so the one already blocked keeps its own, but a loop that runs
        several in turn (each possibly stuck on a send no abort wakes: see the module
        docstring) no longer adds up their timeouts past the abort deadline."""
        for group in list(torch_private.group_names()):
            try:
                self._set_wait(group, AFTER_ABORT_WAIT)
            except Exception:  # noqa: BLE001 - destroyed meanwhile
                pass

    def destroy(self) -> None:
        """Tear the groups down (main thread, after abort())."""
        import torch.distributed as dist

        with self._lock:
            self.epoch = None
            self._sockets = set()
            self._formed = set()
            self._waits = {}
        for declared in self._declared:
            declared.dissolve()
        if dist.is_initialized():
            try:
                torch_private.abort_all_groups()
            except Exception:  # noqa: BLE001 - fall back to the plain teardown
                dist.destroy_process_group()
        if hasattr(self._store, "forget"):  # the node channel's copies of the epoch's reads
            with contextlib.suppress(Exception):  # a channel connection an abort shut: they stay
                self._store.forget()
        self._store = None


def claim_default_group(refuse: Callable[[str], Exception]) -> None:
    """The default group is peerstate's: raise ``refuse(message)`` if the script
    formed one before ``Job()``, and make a later ``torch.distributed.init_process_group``
    from the script raise it at its own line (torch would say only "trying to
    initialize the default process group twice"). ``release_default_group`` undoes it."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise refuse(f"the default process group was initialised before peerstate.Job(): {SCRIPT_DEFAULT_GROUP}")
    original = dist.distributed_c10d.init_process_group

    @functools.wraps(original)
    def refused(*args: Any, **kwargs: Any) -> None:
        raise refuse(f"torch.distributed.init_process_group() was called after peerstate.Job(): "
                     f"{SCRIPT_DEFAULT_GROUP}")

    refused.__wrapped_by_peerstate__ = original
    dist.init_process_group = refused


def release_default_group() -> None:
    import torch.distributed as dist

    dist.init_process_group = getattr(dist.init_process_group, "__wrapped_by_peerstate__", dist.init_process_group)
