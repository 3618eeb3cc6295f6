"""One rank of test_fsdp_shards: FSDP2 (fully_shard) over gloo; each rank registers its
training state and checks that what peerstate snapshots and restores is its own shard."""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import peerstate

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
for layer in model:
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model(torch.randn(8, 16)).sum().backward()
optimizer.step()

store = peerstate.SnapshotStore()
names = peerstate.register_training_state(store, model=model, optimizer=optimizer)
live = {k: v.to_local() for k, v in model.state_dict().items()}
store.snapshot(1).wait()
info = {b[0]: b for b in store.version_info(1)["buffers"]}
moments = optimizer.state[model[0].weight]["exp_avg"].to_local()
before = {k: v.clone() for k, v in live.items()}
moments_before = moments.clone()
with torch.no_grad():
    for p in model.parameters():
        p.to_local().add_(1.0)  # the live shards change in place...
moments.add_(1.0)
store.restore(1)  # ...and come back from the snapshot
result = {
    "rank": rank,
    "registered_shapes": {k: list(v.shape) for k, v in live.items()},
    "snapshot_bytes": {k: info[f"model/{k}"][1] for k in live},
    "restored": all(torch.equal(live[k], before[k]) for k in live) and torch.equal(moments, moments_before),
    "moments_local": list(moments.shape),
    "names": names,
}
print("RESULT " + json.dumps(result), flush=True)
store.close()
dist.destroy_process_group()
sys.exit(0)
