"""torchtitan's ``Trainer`` under peerstate (torchtitan 0.2.x, torch 2.13).

    peerstate run --nproc-per-node 8 --spares 1 -m peerstate.integrations.torchtitan \\
        --job.config_file llama3_8b.toml --debug.seed 0

``PeerstateTrainer`` is torchtitan's ``Trainer`` with three parts replaced, in
the shape of torchft's integration (a subclass handed to ``torchtitan.train.main``;
torchtitan's own files are untouched):

- ``init_distributed``: ``peerstate.Job()`` forms the default group instead of
  ``init_process_group``; ``ParallelDims.build_mesh`` (one world mesh, every
  other view by ``_unflatten``/``_flatten`` with fake backends for size-1
  dimensions) is handed to ``job.build_meshes``, which re-forms its groups in
  every epoch; a hot spare waits there for its rank.
- after ``Trainer.__init__``: ``job.track`` of what torchtitan hands its
  checkpointer: the model parts, the optimizer and LR-scheduler containers, the
  data loader and the trainer's own train state (``step``, ``ntokens_seen``),
  with HSDP's replicas as the shards' copies (``data_parallel="dp_replicate"``);
  and the validator's loader, which its checkpointer does not save (each
  validation reads on from where the last stopped: a replay must too).
- ``train``: each step, and the validation that follows it when one is due
  (``--validation.enable``), in ``job.guard()``; the data iterator is made again
  from the restored loader after a recovery, and a pipeline's schedule again
  over the epoch's "pp" group (the validator's too).

What a torchtitan job must keep to: a pinned ``--debug.seed`` (unpinned,
torchtitan broadcasts rank 0's seed between the meshes and the model, where a
replacement must not communicate: the seed is then pinned to 0 and said so);
no asynchronous checkpointing (it makes a process group of its own). What
torchtitan's own loop did that this one does not: its checkpointer's save and
load (peerstate's ``--checkpoint-dir`` is the disk fallback and the resume), and
``comm.train_timeout_seconds`` after step 1 (peerstate bounds every collective
wait by ``Job(abort_timeout=...)``), and profiling. Not run here: GPU/NCCL.

``--preload peerstate.integrations.torchtitan`` imports torchtitan once per node
(``run`` reads the worker's command line, not the server's); tested on CPU only.
"""

from __future__ import annotations

import sys
from typing import Any, Iterator, Optional

from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims
from torchtitan.train import Trainer, main

import peerstate
from peerstate.worker import torch_private


class PeerstateTrainer(Trainer):
    """torchtitan's Trainer whose state peerstate snapshots every step and recovers."""

    job: peerstate.Job

    def __init__(self, job_config: Any) -> None:
        if job_config.checkpoint.async_mode not in ("disabled", None):
            raise peerstate.InvalidArgumentError(
                f"--checkpoint.async_mode={job_config.checkpoint.async_mode}: asynchronous checkpointing makes a "
                "process group of its own, which no abort reaches; use --checkpoint.async_mode=disabled under "
                "peerstate (its in-memory copies replace most checkpoints)")
        if job_config.debug.seed is None:
            job_config.debug.seed = 0
            print("peerstate: --debug.seed was not set: torchtitan would broadcast rank 0's seed where a replacement "
                  "cannot take part; pinned to 0 (set --debug.seed to choose)", file=sys.stderr, flush=True)
        super().__init__(job_config)
        dims = self.parallel_dims
        extras = {"train_state": self}
        if job_config.validation.enable:  # its loader reads on from where it stopped: its position is state
            extras["validation_loader"] = self.validator.validation_dataloader
        self.job.track(model=self.model_parts, optimizer=self.optimizers, scheduler=self.lr_schedulers,
                       loader=self.dataloader, extras=extras,
                       data_parallel="dp_replicate" if dims.dp_replicate > 1 else False)

    def init_distributed(self) -> ParallelDims:
        config = self.job_config
        self.job = peerstate.Job()
        parallelism = config.parallelism
        dims = ParallelDims(
            dp_shard=parallelism.data_parallel_shard_degree,
            dp_replicate=parallelism.data_parallel_replicate_degree,
            cp=parallelism.context_parallel_degree,
            tp=parallelism.tensor_parallel_degree,
            pp=parallelism.pipeline_parallel_degree,
            ep=parallelism.expert_parallel_degree,
            etp=parallelism.expert_tensor_parallel_degree,
            world_size=self.job.world_size,
        )
        # The dense mesh's dimensions, for data_parallel="dp_replicate": a spare must know
        # its replica set before it has a rank to build the meshes with.
        fsdp = dims.dp_shard * dims.cp
        layout = [("pp", dims.pp), ("dp_replicate", dims.dp_replicate), ("fsdp", fsdp), ("tp", dims.tp)]
        self.job.build_meshes(dims.build_mesh, layout=layout)
        self.job.wait_for_rank()
        return dims

    def train(self) -> None:
        config = self.job_config
        iterator: Optional[Iterator[Any]] = None
        recoveries = -1
        for index in self.job.steps(config.training.steps):
            if self.job.recoveries != recoveries:  # the loader was restored: read on from where it stands
                if recoveries >= 0 and self.parallel_dims.pp_enabled:
                    self._rebuild_pipeline()
                iterator, recoveries = self.batch_generator(self.dataloader), self.job.recoveries
            with self.job.guard():
                self.step = index + 1  # torchtitan counts steps from 1
                self.gc_handler.run(self.step)
                self.train_step(iterator)
                # In the guard: its collectives are aborted and it is run again with the step.
                if config.validation.enable and self.validator.should_validate(self.step):
                    self.validator.validate(self.model_parts, self.step)

    def _rebuild_pipeline(self) -> None:
        """The schedule's stages hold the "pp" group of the epoch they were built in, which
        the recovery aborted: the same stages (model parts, indices) over this epoch's
        group, in a schedule built as torchtitan builds it."""
        from torch.distributed.pipelining import PipelineStage
        from torchtitan.distributed.pipeline_parallel import build_pipeline_schedule

        old = self.pp_schedule
        stages = torch_private.pipeline_stages(old)
        group = self.parallel_dims.get_mesh("pp").get_group("pp")
        fresh = [PipelineStage(s.submod, s.stage_index, s.num_stages, s.device, group=group) for s in stages]
        self.pp_schedule = build_pipeline_schedule(self.job_config, fresh, self.loss_fn)
        if self.job_config.validation.enable:
            self.validator.pp_schedule = self.pp_schedule  # it evaluates through the same stages

    def close(self) -> None:
        super().close()
        self.job.close()


def run(trainer_class: type = PeerstateTrainer) -> None:
    """torchtitan's ``main`` with ``trainer_class``, its config parsed from ``sys.argv`` as it
    stands now. torchtitan binds ``ConfigManager.parse_args``'s default to ``sys.argv`` when
    its config module is imported: imported in a fork server (``--preload``), that is the
    server's command line, and every worker would train with the server's config, silently."""
    ConfigManager.parse_args.__defaults__ = (sys.argv[1:],)
    main(trainer_class)


if __name__ == "__main__":
    run()
