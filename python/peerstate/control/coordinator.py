"""The recovery coordinator: membership, epochs, the spare pool and recovery plans,
kept in the job's KeyValueStore.

There is no coordinator process. Whoever sees a failure (the node agent that
reaped a worker, or an agent that saw another node's lease expire) writes the
next epoch's plan; ``compare_set`` on the epoch's owner key makes exactly one
writer win, and a loser whose failure the winning plan does not cover tries
the epoch after. Workers learn of an epoch by waiting on its plan key.

A writer can die part way (its node lost during a recovery). Before its plan
is written: a loser waiting for that plan takes the epoch over (compare_set
of the owner key from the lost writer to itself) once the writer's node is
declared dead, and writes the plan itself; a spare the lost writer had
claimed stays out of the pool. Once its plan is written, the plan is the
truth: a spare learns its rank from the plan itself, which its agent copies
into the node channel (``worker.membership.wait_for_assignment``).

Its keys are in ``keys`` (the spares, the epochs' owners and plans, the
nodes' dead flags, the job's failure).

A worker is named ``n{node}.{k}``: its node is part of its name, so a plan
can leave out the spares of a dead node without asking anyone.
"""

from __future__ import annotations

import json
import time
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

from peerstate.control import keys
from peerstate.control.kvstore import KeyValueStore
from peerstate.control.messages import RecoveryPlan
from peerstate.control.planning import node_of_agent, node_of_worker
from peerstate.errors import JobFailedError


class Members(Mapping[int, str]):
    """rank -> worker in an epoch: epoch 0's layout (rank r is worker ``n{r // nproc}.{r %
    nproc}``) and the ranks replaced since. Made and folded in O(1) per plan, read in O(1)
    per rank: every agent and every node relay holds one, and a dict of every rank each
    (16,384 entries at 16,384 ranks, built at start) cost the 2,048 simulated nodes of
    ``bench/scale.py`` 33 M entries. Iterating it is O(ranks); ``on_node`` and ``ranks_of``
    are not."""

    def __init__(self, world_size: int, nproc_per_node: int, replaced: Optional[Mapping[int, str]] = None) -> None:
        self.world_size, self.nproc_per_node = world_size, nproc_per_node
        self._replaced: Dict[int, str] = dict(replaced or {})

    def __getitem__(self, rank: int) -> str:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise KeyError(rank)
        worker = self._replaced.get(rank)
        return worker if worker is not None else f"n{rank // self.nproc_per_node}.{rank % self.nproc_per_node}"

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.world_size))

    def __len__(self) -> int:
        return self.world_size

    def update(self, replaced: Mapping[int, str]) -> None:
        """Fold in a plan's replaced ranks."""
        self._replaced.update(replaced)

    def copy(self) -> "Members":
        return Members(self.world_size, self.nproc_per_node, self._replaced)

    def ranks_of(self, workers: Iterable[str]) -> List[int]:
        """The ranks ``workers`` hold (sorted)."""
        wanted = set(workers)
        ranks = {r for r, w in self._replaced.items() if w in wanted}
        for worker in wanted:
            node, _, index = worker[1:].partition(".")
            rank = int(node) * self.nproc_per_node + int(index)
            if int(index) < self.nproc_per_node and rank < self.world_size and rank not in self._replaced:
                ranks.add(rank)
        return sorted(ranks)

    def on_node(self, node: int) -> List[str]:
        """The workers of ``node`` that hold a rank."""
        first = node * self.nproc_per_node
        initial = [self[r] for r in range(first, min(first + self.nproc_per_node, self.world_size))
                   if r not in self._replaced]
        return initial + [w for w in self._replaced.values() if node_of_worker(w) == node]


class Coordinator:
    """The coordinator's operations over the job's store (used by the agents;
    workers only read plans)."""

    def __init__(self, kv: KeyValueStore) -> None:
        self.kv = kv
        self._latest: Optional[RecoveryPlan] = None  # the newest plan read, members folded in
        self._shape: Optional[Dict[str, int]] = None

    # -- epochs ----------------------------------------------------------------------
    def plan(self, epoch: int, present: bool = False) -> Optional[RecoveryPlan]:
        """Epoch ``epoch``'s plan as written (without ``members``; see ``latest_plan``).
        ``present``: it is known to exist (one request instead of two)."""
        key = keys.epoch_plan(epoch)
        raw = self.kv.get_existing([key])[0] if present else self.kv.get(key)
        return RecoveryPlan.decode(raw) if raw else None

    def latest_plan(self) -> RecoveryPlan:
        """The newest plan, with ``members`` folded from epoch 0's layout and every
        plan's changes. Reads only the plans this coordinator has not seen yet (one
        request when there is none)."""
        self.new_plans()
        return self._latest

    def new_plans(self, known: int = -1, upto: Optional[int] = None) -> List[RecoveryPlan]:
        """The plans written since the last call (oldest first; the newest with
        ``members`` folded in); the first call includes epoch 0's. ``known``: the plans up to that epoch are
        known to exist (a wait on them returned), which saves a request each. ``upto``: read
        no plan past that epoch (no request to look for a newer one)."""
        seen: List[RecoveryPlan] = []
        if self._latest is None:
            plan = self.plan(0, present=known >= 0)
            if plan is None:
                raise JobFailedError("the job has no epoch-0 plan: the agents have not started it")
            shape = self.shape()
            plan.members = Members(shape["world_size"], shape["nproc_per_node"])
            self._latest = plan
            seen.append(plan)
        while upto is None or self._latest.epoch < upto:
            newer = self.plan(self._latest.epoch + 1, present=self._latest.epoch + 1 <= known)
            if newer is None:
                return seen
            # One membership, updated in place (copying N entries per plan would cost every agent O(N)):
            # only the newest plan holds it, older ones are handed out without.
            newer.members, self._latest.members = self._latest.members, {}
            newer.members.update(newer.replaced)
            self._latest = newer
            seen.append(newer)
        return seen

    def shape(self) -> Dict[str, int]:
        """The job's shape (``keys.CONFIG``: nnodes, nproc_per_node, world_size), read once."""
        if self._shape is None:
            raw = self.kv.get(keys.CONFIG)
            if not raw:
                raise JobFailedError("the job's store holds no config: the agents have not started it")
            self._shape = json.loads(raw)
        return self._shape

    def start(self, me: str) -> RecoveryPlan:
        """Write the epoch-0 plan (idempotent: every agent calls it; the first one
        owns epoch 0 and writes its instructions)."""
        owner = self.kv.compare_set(keys.epoch_owner(0), b"", me.encode()).decode()
        plan = RecoveryPlan(0, reason="start", planned_at=time.time(), writer=owner)
        self.kv.compare_set(keys.epoch_plan(0), b"", plan.encode())
        return self.plan(0)

    # -- spares ----------------------------------------------------------------------
    def register_spare(self, worker: str) -> None:
        self.kv.set(keys.spare_state(worker), b"ready")
        self.kv.append(keys.SPARES, f"{worker},".encode())

    def spare_gone(self, worker: str) -> Optional[Tuple[int, int]]:
        """Take a dead spare out of the pool. Returns (epoch, rank) if it had already
        been assigned (then its death is that rank's failure)."""
        now = self.kv.compare_set(keys.spare_state(worker), b"ready", b"gone").decode()
        if now.startswith("assigned:"):
            _, epoch, rank = now.split(":")
            return int(epoch), int(rank)
        return None

    def ready_spares(self) -> List[str]:
        raw = (self.kv.get(keys.SPARES) or b"").decode()
        ids = [w for w in raw.split(",") if w]
        dead_nodes = self.dead_nodes()
        ids = [w for w in ids if node_of_worker(w) not in dead_nodes]
        states = self.kv.get_many([keys.spare_state(w) for w in ids])
        return [w for w, s in zip(ids, states) if s == b"ready"]

    # -- nodes -----------------------------------------------------------------------
    def declare_node_dead(self, node: int, me: str) -> bool:
        """Mark ``node`` lost; True for the one caller that did it (the others see it done)."""
        if self.kv.compare_set(keys.node_dead(node), b"", me.encode()) != me.encode():
            return False
        self.kv.append(keys.DEAD_NODES, f"{node},".encode())
        return True

    def workers_on(self, node: int) -> List[str]:
        """The members of the newest plan that run on ``node`` (what its loss fails)."""
        return self.latest_plan().members.on_node(node)

    def node_dead(self, node: Optional[int]) -> bool:
        return node is not None and bool(self.kv.get(keys.node_dead(node)))

    def dead_nodes(self) -> Set[int]:
        """Every node declared lost (one read, whatever the number of nodes)."""
        return {int(n) for n in (self.kv.get(keys.DEAD_NODES) or b"").decode().split(",") if n}

    # -- failures --------------------------------------------------------------------
    def report_failure(self, workers: Iterable[str], reason: str, *, detected_at: float,
                       me: str, spare_timeout: float = 30.0, writer_grace: float = 30.0) -> Optional[RecoveryPlan]:
        """Replace the ranks the dead ``workers`` hold. Returns the plan that does so
        (this caller's or a concurrent one's), or None if none of them is a member.

        Blocks while another writer holds the epoch, up to ``spare_timeout +
        writer_grace`` (it may be waiting for a spare), and takes the epoch over if
        that writer's node is declared dead first. Raises JobFailedError when no
        spare becomes ready within ``spare_timeout``, or when the other writer
        neither writes its plan nor is declared dead in time.
        """
        dead = set(workers)
        while True:
            current = self.latest_plan()
            failed = current.members.ranks_of(dead)
            if not failed:
                return None  # already replaced by an earlier plan
            epoch = current.epoch + 1
            owner = self.kv.compare_set(keys.epoch_owner(epoch), b"", me.encode())
            if owner != me.encode() and not self.wait_or_take_over(epoch, keys.epoch_plan(epoch), me,
                                                                   spare_timeout + writer_grace, "recovery plan"):
                continue  # re-read: the winner's plan may or may not cover our failure
            replaced = self._assign_spares(epoch, failed, current, spare_timeout)
            plan = RecoveryPlan(epoch, {}, replaced, failed, reason, detected_at, time.time(), me,
                                current.collective_timeout)
            self.kv.set(keys.epoch_plan(epoch), plan.encode())
            self._retire(epoch - 1)
            plan.members, current.members = current.members, {}  # fold it in, as new_plans does
            plan.members.update(replaced)
            self._latest = plan
            return plan

    def regroup(self, seen: int, reason: str, *, writer: str, me: str,
                collective_timeout: float) -> Optional[RecoveryPlan]:
        """Start epoch ``seen`` + 1 with the same members and a gloo collective timeout of
        ``collective_timeout`` (every member rolls back and re-forms its groups; nobody is
        replaced). ``writer``: the agent whose node relay writes its instructions (the
        caller's own); ``me``: the member asking. Returns None, writing nothing, when epoch
        ``seen`` + 1 began already (another member asked first, or a failure was
        declared): that epoch re-forms the groups as well."""
        epoch = seen + 1
        claim = f"{writer}/{me}".encode()  # not the agent's own name: its report_failure must not see it as its claim
        if self.kv.compare_set(keys.epoch_owner(epoch), b"", claim) != claim:
            return None
        current = self.latest_plan()
        plan = RecoveryPlan(epoch, {}, {}, [], reason, time.time(), time.time(), writer, collective_timeout)
        self.kv.set(keys.epoch_plan(epoch), plan.encode())
        self._retire(seen)
        plan.members = current.members.copy()
        return plan

    def _retire(self, epoch: int) -> None:
        """Epoch ``epoch`` is moot (the next one's plan is written): say so in every node's
        instructions key, so that node relays waiting there for instructions that will
        never come (their writer sees the newer epoch and stops) move on at once, instead
        of each looking for a newer epoch every so often (at 2,048 nodes, a herd of
        10,000 requests a second). One request; a node that read its instructions
        already never reads them again."""
        nnodes = self.shape()["nnodes"]
        self.kv.set_many([(keys.node_instructions(epoch, node), keys.MOOT) for node in range(nnodes)])

    def wait_or_take_over(self, epoch: int, done_key: str, me: str, timeout: float, what: str,
                          newer: Optional[Callable[[], bool]] = None, poll: float = 0.25) -> bool:
        """Wait for epoch ``epoch``'s owner to write ``done_key``: False once it is
        written (or once ``newer()`` says a newer epoch made it moot), True once this
        caller took the epoch over from an owner whose node was declared dead.
        ``poll``: how often it looks for a newer epoch or a lost owner (three
        requests each time). JobFailedError when the owner neither writes nor is
        declared dead in ``timeout``."""
        key = keys.epoch_owner(epoch)
        owner, taken = b"", False

        def moot() -> bool:
            nonlocal owner, taken
            if newer is not None and newer():
                return True
            owner = self.kv.get(key) or b""
            # Another survivor may take it over first: then this caller waits for that one.
            taken = (self.node_dead(node_of_agent(owner.decode()))
                     and self.kv.compare_set(key, owner, me.encode()) == me.encode())
            return taken

        try:
            self.kv.wait_until([done_key], time.monotonic() + timeout, moot, poll)
        except TimeoutError:
            owner = self.kv.get(key) or owner
            raise JobFailedError(
                f"{owner.decode()} began epoch {epoch}'s {what} but neither wrote it nor was declared "
                f"lost within {timeout:.0f}s; the job cannot recover. Check that agent's node and its log.") from None
        return taken

    def assignments(self, spares: Sequence[str]) -> Dict[str, int]:
        """The ranks the latest plan gives to any of these waiting ``spares``."""
        plan = self.latest_plan()
        return {w: r for w in set(spares) for r in plan.members.ranks_of([w])}

    def _assign_spares(self, epoch: int, failed: Sequence[int], current: RecoveryPlan,
                       timeout: float) -> Dict[int, str]:
        """Claim one ready spare per failed rank, preferring the failed worker's own node
        (its buddies were chosen to be elsewhere). Waits for the pool to refill."""
        deadline = time.monotonic() + timeout
        replaced: Dict[int, str] = {}
        asked = False
        for rank in failed:
            home = node_of_worker(current.members[rank])
            while rank not in replaced:
                spares = sorted(self.ready_spares(), key=lambda w: (node_of_worker(w) != home, w))
                for worker in spares:
                    claim = f"assigned:{epoch}:{rank}".encode()
                    if self.kv.compare_set(keys.spare_state(worker), b"ready", claim) == claim:
                        replaced[rank] = worker
                        break
                else:
                    if not asked:  # agents hold back refills during a recovery unless asked
                        self.kv.add(keys.SPARES_WANTED, 1)
                        asked = True
                    if time.monotonic() > deadline:
                        for r, worker in replaced.items():  # give back what was claimed
                            self.kv.compare_set(keys.spare_state(worker), f"assigned:{epoch}:{r}".encode(), b"ready")
                        raise JobFailedError(
                            f"no hot spare became ready within {timeout:.0f}s to replace rank {rank} "
                            "(every spare started so far is in use or lost). Start the job with more --spares.")
                    time.sleep(0.05)
        return replaced

    def fail_job(self, message: str) -> str:
        """Record why the job stops (the first reason wins); returns the recorded one."""
        return self.kv.compare_set(keys.JOB_FAILED, b"", message.encode()).decode()

    def failure(self) -> Optional[str]:
        raw = self.kv.get(keys.JOB_FAILED)
        return raw.decode() if raw else None
