"""torchtitan on a machine without a GPU, for the tests' harness (``torchtitan_job.py``):
imported before anything else imports torchtitan, by the harness or by a fork
server that preloads it (``--preload ...,torchtitan_cpu``, with this folder on
``PYTHONPATH``), so that every worker forked from it has torchtitan imported
and shimmed once.

The shims (torchtitan has CUDA-only corners on a machine without a GPU): its
device type falls back to "cuda" when no accelerator is found (it reads the type
as it loads); its memory monitor reads CUDA's statistics; and FSDP's
reduce-scatter with its gradient division turned off is a PREMUL_SUM, which
gloo refuses (forced to a sum). Nothing here reads the command line: torchtitan
parses the worker's (``peerstate.integrations.torchtitan.run``)."""

from types import SimpleNamespace

import torch._utils

torch._utils._get_available_device_type = lambda: "cpu"  # before torchtitan reads it

from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torchtitan.components import metrics  # noqa: E402
from torchtitan.models.llama3.infra import parallelize as llama_parallelize  # noqa: E402

from peerstate.integrations.torchtitan import PeerstateTrainer, run  # noqa: E402

__all__ = ["PeerstateTrainer", "run"]  # the harness's, from here: imported after the shims


class _NoDeviceMemory:
    device_name = "cpu"

    def get_peak_stats(self):
        return SimpleNamespace(max_active_gib=0, max_active_pct=0, max_reserved_gib=0, max_reserved_pct=0,
                               num_alloc_retries=0, num_ooms=0)

    def reset_peak_stats(self):
        pass


metrics.build_device_memory_monitor = lambda: _NoDeviceMemory()
_divide_off = llama_parallelize.disable_fsdp_gradient_division


def _divide_off_and_sum(model):
    _divide_off(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


llama_parallelize.disable_fsdp_gradient_division = _divide_off_and_sum
