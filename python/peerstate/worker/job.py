"""The worker's side of a peerstate job: join, train, and turn failures into recoveries.

The whole integration with a training loop::

    job = peerstate.Job()
    model = Net(); optimizer = torch.optim.AdamW(model.parameters())
    job.track(model=model, optimizer=optimizer, scheduler=scheduler)  # a hot spare waits here
    ddp = job.ddp(model)                        # DistributedDataParallel, rebuilt after a recovery
    for step in job.steps(1000):                # resumes at v+1 after a recovery
        with job.guard():                       # a failure in here becomes a recovery
            loss = loss_fn(ddp(batch(step)))
            optimizer.zero_grad(); loss.backward(); optimizer.step()
    job.close()

The contract a script keeps (a hot spare runs it up to ``track()`` ahead of time,
so code before it must not depend on the rank; batch ``step`` is drawn from the
step number or a tracked loader, so that a replayed step sees the same data) is
in docs/training-script.md; what happens at each step boundary and in a recovery,
in docs/snapshots-and-replication.md and docs/recovery.md.
"""

from __future__ import annotations

import atexit
import functools
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Sequence, Tuple, Union

from peerstate.errors import InvalidArgumentError
from peerstate.worker.assembly import assemble
from peerstate.worker.membership import MemberState
from peerstate.worker.meshes import BuiltMeshes, DeclaredMesh
from peerstate.worker.options import JobOptions
from peerstate.worker.process_groups import Subgroup
from peerstate.worker.rebuild import RebuildableDDP
from peerstate.worker.step_guard import StepGuard


class Job:
    """This process's membership in a peerstate job (see the module docstring).
    A script reads ``rank``, ``epoch``, ``next_step``, ``recoveries``, ``world_size``,
    ``backend``, ``capture``, ``extras`` and ``memory()``; the parts are private
    (``assembly``). The arguments are ``JobOptions``'s, documented there
    (``peerstate.worker.options``); a combination that cannot work raises
    InvalidArgumentError."""

    def __init__(self, *, snapshot_every: int = 1, versions: int = 4, k: int = 1, backend: Optional[str] = None,
                 checkpoint_dir: Optional[str] = None, checkpoint_every: int = 0, join_timeout: float = 120.0,
                 failure_grace: float = 30.0, replica_budget_bytes: Optional[int] = None,
                 snapshot_threads: Optional[int] = None, abort_timeout: float = 60.0,
                 data_parallel_shares: Optional[int] = None, parity_group: int = 0) -> None:
        options = JobOptions(snapshot_every=snapshot_every, versions=versions, k=k, parity_group=parity_group,
                             backend=backend, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                             join_timeout=join_timeout, failure_grace=failure_grace,
                             replica_budget_bytes=replica_budget_bytes, snapshot_threads=snapshot_threads,
                             abort_timeout=abort_timeout, data_parallel_shares=data_parallel_shares)
        self._parts = parts = assemble(options)
        self.world_size, self.backend = parts.env.world_size, parts.backend
        self._guard: Optional[StepGuard] = None  # the current step's
        atexit.register(self.close)  # an exception out of the loop still stops the threads in order
        if parts.env.spare:
            _warm_up()
        else:
            parts.take_rank(parts.plan(0), parts.env.rank)

    # -- what the script reads -----------------------------------------------------
    @property
    def rank(self) -> Optional[int]:
        """This process's rank (None while a spare waits for one)."""
        return self._parts.membership.rank

    @property
    def epoch(self) -> int:
        return self._parts.membership.epoch

    @property
    def next_step(self) -> int:
        """The step the loop runs next."""
        return self._parts.membership.next_step

    @property
    def recoveries(self) -> int:
        return self._parts.joiner.recoveries

    @property
    def capture(self) -> bool:
        """False: steps are not snapshotted (for overhead measurements only; also set by
        ``PEERSTATE_CAPTURE=0``, which the benchmarks use to run a script without it)."""
        return self._parts.boundary.capture

    @capture.setter
    def capture(self, value: bool) -> None:
        self._parts.boundary.capture = value

    # -- the loop --------------------------------------------------------------------
    def ddp(self, model: Any, **options: Any) -> RebuildableDDP:
        """Wrap ``model`` in a ``DistributedDataParallel`` (``options`` are DDP's), which
        the job rebuilds in place on every re-formed group: the same object, a real
        DDP subclass, keeping what the script set on it (``RebuildableDDP``). A
        replacement skips DDP's initial broadcast: its state arrives from the buddies."""
        self.wait_for_rank()
        parts = self._parts
        return parts.wrappers.wrap(model, options, self.epoch, parts.membership.replacement, parts.options.join_timeout)

    def new_group(self, ranks: Sequence[int], **options: Any) -> Subgroup:
        """Declare a process group over some ranks (``torch.distributed.new_group``'s
        ``ranks`` and options): peerstate aborts it with the default group when a
        failure hits and forms it again in every epoch. Every process calls it, in
        the same order, before ``track()`` (a spare too: it forms its subgroups when
        it is given a rank). Pass ``subgroup.group`` to collectives."""
        return self._parts.declare("new_group()", lambda: Subgroup.declared(ranks, options, self.world_size))

    def device_mesh(self, device_type: str, mesh_shape: Sequence[int], *,
                    mesh_dim_names: Optional[Sequence[str]] = None) -> DeclaredMesh:
        """Declare a ``DeviceMesh`` (``init_device_mesh``'s arguments) whose groups
        peerstate aborts on a failure and re-forms in every epoch; ``.mesh`` is the
        torch ``DeviceMesh``, the same object across recoveries (see ``meshes``).
        The same rules as ``new_group``: every process, same order, before
        ``track()``; a spare's ``.mesh`` exists once ``wait_for_rank()`` returns."""
        return self._parts.declare("device_mesh()", lambda: DeclaredMesh.declared(device_type, mesh_shape,
                                                                                   mesh_dim_names, self.world_size))

    def build_meshes(self, builder: Callable[[], Any], *,
                     layout: Optional[Sequence[Tuple[str, int]]] = None) -> BuiltMeshes:
        """Declare the script's own mesh builder: a function that builds every mesh it
        needs with torch's DeviceMesh API (``init_device_mesh``, ``_unflatten``,
        ``_flatten``, slicing, ``backend_override``) and returns them, as torchtitan's
        ``ParallelDims.build_mesh`` does. peerstate runs it now (a spare: once it has a
        rank) and again in every epoch after its own groups, and aborts and re-forms
        its groups with them; ``.value`` is what the first call returned, valid across
        recoveries (see ``meshes``). ``layout``: the world mesh's (name, size) pairs, for
        ``track(data_parallel=NAME)``. The same rules as ``new_group``."""
        return self._parts.declare("build_meshes()", lambda: BuiltMeshes.declared(builder, layout, self.world_size))

    def track(self, *, model: Any = None, optimizer: Any = None, scheduler: Any = None, loader: Any = None,
              extras: Optional[Mapping[str, Any]] = None, data_parallel: Union[bool, str] = False) -> None:
        """Say what the training state is. ``scheduler`` and ``loader`` need
        ``state_dict()``/``load_state_dict()``; the RNG states of Python, NumPy,
        torch and CUDA are always captured. Each of ``extras`` is an object with
        both methods (restored in place) or a plain picklable value (a best
        validation loss, a counter): read and write those through ``job.extras``
        (``job.extras["best_loss"] = loss``), which a restore sets back.

        Optimizer state appears at the first step, so a worker registers it at the
        first step boundary. A hot spare runs the script up to here ahead of time:
        it materialises the optimizer state, registers and allocates everything,
        and only then waits for a rank, so code before ``track()`` must not depend
        on the rank. Once given one it pulls the state and returns.

        ``data_parallel=True`` says that model, optimizer and scheduler state are the
        same on every rank (DistributedDataParallel): they are then not replicated;
        each rank snapshots its share of them (``data_parallel_shares``), and a rank
        that recovers pulls the shares it lacks from the surviving ranks' own
        snapshots (no replication traffic, no extra memory). Only each rank's own
        state (RNG, loader, extras) goes to its buddies. ``data_parallel`` may
        instead name a dimension of a mesh declared with ``device_mesh``: that state
        is then the same on the ranks along it (HSDP: ``"replicate"``, where the
        rank at the same place of every replica group holds the same shard), which
        are each other's copies in the same way."""
        self._parts.track(dict(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader), extras or {},
                          data_parallel)
        self.wait_for_rank()
        self._parts.restore_pending()

    @property
    def extras(self) -> Dict[str, Any]:
        """The ``extras`` given to ``track()``, by name; a plain value is snapshotted
        from here at each step boundary and set back here by a restore."""
        return self._parts.tracked.extras

    def memory(self) -> Dict[str, int]:
        """Host memory this rank holds for recoveries, in bytes: ``snapshot_per_version``
        (what it copies each step: its own state and its share of the data-parallel
        state), ``snapshots_held`` (the version slots of all its stores, as allocated
        now), ``replicas_held`` and ``replicas_reserved`` (its buddies' state kept
        here; 0 for a spare without a rank)."""
        return self._parts.memory()

    def steps(self, total: int) -> Iterator[int]:
        """Yield step numbers from where the job stands (0, or the step after the disk
        checkpoint a new job resumed from in ``track()``) to ``total`` - 1, recovering
        between steps when a failure was caught by ``guard``."""
        parts = self._parts
        while True:
            parts.recover_if_due()
            if self.next_step >= total:
                break
            self._guard = None
            yield self.next_step
            if self._guard is None and parts.membership.state is not MemberState.RECOVERING:
                raise InvalidArgumentError("wrap the body of the steps() loop in `with job.guard():`")
        parts.finish(total)

    def guard(self) -> StepGuard:
        """Context manager for one step's body: a failure inside becomes a recovery."""
        self._guard = self._parts.step_guard()
        return self._guard

    def guarded(self, step_function: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: every call runs in ``guard()``. For a loop whose body moves into a
        function as it is, without re-indenting it under a ``with``::

            @job.guarded
            def train_step(step):
                ...                                # the old loop body, unchanged
            for step in job.steps(total_steps):
                train_step(step)

        A call returns the function's result, or None when a failure interrupted it
        (the step is then replayed by the recovery). Names the body rebinds across
        steps need ``global`` (or ``job.extras``) there, as in any function."""
        @functools.wraps(step_function)
        def run_guarded(*args: Any, **kwargs: Any) -> Any:
            with self.guard():
                return step_function(*args, **kwargs)

        return run_guarded

    def wait_for_rank(self) -> int:
        """A spare: block until a plan gives this process a rank (a worker returns at
        once). Call it before building anything that needs the process group, such
        as FSDP2's ``fully_shard``; the spare is then less ready (it builds its model
        after being picked). Returns the rank."""
        if self.rank is not None:
            return self.rank
        self._parts.wait_for_rank()
        return self.rank

    def close(self) -> None:
        """Stop watching, serving and snapshotting (call once the loop is done)."""
        if self._parts.membership.state is not MemberState.CLOSED:
            self._parts.membership.move(MemberState.CLOSED)
            self._parts.close()

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _warm_up() -> None:
    """What a spare does while it waits: import what the first optimizer (torch._dynamo,
    about a second), DDP and checkpointing import lazily, so a replacement starts warm."""
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.nn.parallel  # noqa: F401
