"""torchtitan's llama3 debug model under ``peerstate.integrations.torchtitan``, on
CPU/gloo, for the e2e tests. Takes the test jobs' ``--steps``/``--out`` and a
``--layout``; prints "rank R step S" after each step (S counted from 0, as
``job.steps``) and writes each rank's final model and optimizer shards and train
state to ``--out``.

The CPU shims are in ``torchtitan_cpu`` (a fork server may have imported it
already: the tests preload it)."""

import argparse
import os
import sys

LAYOUTS = {"hsdp": ["--parallelism.data_parallel_replicate_degree", "2",
                    "--parallelism.data_parallel_shard_degree", "2"],
           "fsdp_tp": ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
           "pp_fsdp": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]}

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--layout", choices=sorted(LAYOUTS), default="hsdp")
parser.add_argument("--assets", required=True, help="a folder with tokenizer/ and data/ (tests/integrations)")
parser.add_argument("--validate-every", type=int, default=0,
                    help="torchtitan's validation every N steps (2 batches)")
args, rest = parser.parse_known_args()
if args.validate_every:
    rest += ["--validation.enable", "--validation.dataset", "c4_test", "--validation.dataset_path",
             os.path.join(args.assets, "data"), "--validation.freq", str(args.validate_every), "--validation.steps", "2",
             "--validation.seq_len", "64", "--validation.local_batch_size", "2"]

os.environ["LOCAL_RANK"] = "0"  # the one CPU device (peerstate itself never reads it)
# the command line torchtitan parses (run() reads it as it stands, preloaded or not)
sys.argv = [sys.argv[0], "--model.hf_assets_path", os.path.join(args.assets, "tokenizer"),
            "--training.dataset", "c4_test", "--training.dataset_path", os.path.join(args.assets, "data"),
            "--training.steps", str(args.steps), "--training.seq_len", "64", "--training.local_batch_size", "2",
            "--training.mixed_precision_param", "float32", "--debug.seed", "7",
            "--metrics.log_freq", "1000", "--job.dump_folder", args.out, *LAYOUTS[args.layout], *rest]

import torch  # noqa: E402
from torchtitan_cpu import PeerstateTrainer, run  # noqa: E402


class TestTrainer(PeerstateTrainer):
    def __init__(self, job_config):
        super().__init__(job_config)
        print(f"rank {self.job.rank} pid {os.getpid()}", flush=True)  # what the tests' kill_rank reads

    def train_step(self, data_iterator):
        super().train_step(data_iterator)
        print(f"rank {self.job.rank} step {self.step - 1}", flush=True)

    def close(self):
        final = {}
        for i, part in enumerate(self.model_parts):
            for name, value in part.state_dict().items():
                final[f"part{i}/{name}"] = (value.to_local() if hasattr(value, "to_local") else value).clone()
        for i, optimizer in enumerate(self.optimizers.optimizers):
            for index, state in enumerate(optimizer.state.values()):
                for key, value in state.items():
                    final[f"optimizer{i}/{index}/{key}"] = (value.to_local() if hasattr(value, "to_local")
                                                            else value).clone()
        final["train_state"] = torch.tensor([self.step, self.ntokens_seen])
        torch.save(final, os.path.join(args.out, f"rank{self.job.rank}.pt"))
        super().close()


run(TestTrainer)
