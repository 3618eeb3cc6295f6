"""A rank for the replication tests: a real process with a SnapshotStore and a
Replication endpoint, driven by JSON lines on stdin (one reply line each on
stdout). Its state at version v is a deterministic function of (rank, v), so
any process can tell what a rank's state at v must be, bit for bit."""

import hashlib
import json
import sys
import traceback

import torch

import peerstate


def fill(tensors, rank, version):
    for i, t in enumerate(tensors.values()):
        g = torch.Generator().manual_seed(rank * 1_000_003 + version * 7919 + i)
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=g))


def make_tensors(large_bytes, small_count, small_bytes):
    tensors = {}
    for i in range(2):
        tensors[f"large/{i}"] = torch.empty(large_bytes // 2, dtype=torch.uint8)
    for i in range(small_count):
        tensors[f"small/{i:05d}"] = torch.empty(small_bytes // 4, dtype=torch.float32)
    return tensors


def digest_tensors(tensors):
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def digest_region(info, raw):
    h = hashlib.sha256()
    for name, nbytes, _device, offset, _dtype in sorted(info["buffers"]):
        h.update(name.encode())
        h.update(raw[offset : offset + nbytes])
    return h.hexdigest()


class Peer:
    def __init__(self):
        self.replication = None

    def setup(self, rank, nodes, k, secret, large_bytes, small_count, small_bytes=1024, chunk_bytes=1 << 20,
              connections=4, io_timeout=20.0, groups=None, state_rank=None):
        self.rank = rank
        self.state_rank = rank if state_rank is None else state_rank  # replica-group members share a state
        self.spec = (large_bytes, small_count, small_bytes)
        self.tensors = make_tensors(*self.spec)
        self.store = peerstate.SnapshotStore(chunk_bytes=chunk_bytes, threads=1)
        self.store.register_many(self.tensors)
        self.placement = peerstate.BuddyPlacement(nodes, k=k, replica_groups=groups)
        self.replication = peerstate.Replication(
            self.store, rank, self.placement, credentials=peerstate._C.JobAuthority(bytes.fromhex(secret)).issue(rank),
            connections_per_peer=connections, io_timeout=io_timeout)
        return {"port": self.replication.address[1], "bytes_per_version": self.store.memory()["bytes_per_version"]}

    def connect(self, addresses):
        self.replication.connect({int(r): (h, p) for r, (h, p) in addresses.items()})
        return {}

    def reserve(self, sizes):
        self.replication.reserve({int(r): n for r, n in sizes.items()})
        return {}

    def step(self, version, replicate=True):
        fill(self.tensors, self.state_rank, version)
        self.store.snapshot(version).wait()
        if replicate:
            self.replication.replicate(version)
        return {"digest": digest_tensors(self.tensors)}

    def replicate(self, version):
        self.replication.replicate(version)
        return {}

    def roll_back(self, version):
        self.store.restore(version)
        return {}

    def drop_newer(self, version):
        self.replication.drop_newer(version)
        return {"held": self.replication.held_versions()}

    def wait(self, version):
        results = self.replication.wait(version, check=False)
        return {"results": {str(h): (None if e is None else f"{type(e).__name__}: {e}") for h, e in results.items()}}

    def holdings(self):
        out = {}
        for source, version in self.replication.holdings().items():
            info = self.replication.replicas.info(source)
            out[str(source)] = {"version": version,
                                "digest": digest_region(info, self.replication.replicas.stored_bytes(source))}
        return {"holdings": out}

    def expected(self, rank, version):
        tensors = make_tensors(*self.spec)
        fill(tensors, rank, version)
        return {"digest": digest_tensors(tensors)}

    def describe(self, peer, rank, version=-1):
        return {"meta_version": self.replication.transport.describe(peer, rank, version)["version"]}

    def recover(self, rank, version=-1, sources=None, same_machine=None):
        local = {int(p): tuple(v) for p, v in (same_machine or {}).items()}
        pulled = self.replication.pull(rank, version, sources, same_machine=local)
        self.store.restore(pulled, verify=False)
        reply = {"version": pulled, "digest": digest_tensors(self.tensors)}
        if same_machine is not None:
            reply.update(self.replication.last_pull)
        return reply

    def region(self, version):
        import os

        return {"pid": os.getpid(), "address": self.store.region_address(version)}

    def port(self):
        return {"port": self.replication.address[1]}

    def index(self):
        import os

        return {"pid": os.getpid(), "address": self.replication.index_stores()}

    def adopt(self, pid, address):
        from peerstate.replication.stopped_holder import StoppedHolder

        holder = StoppedHolder(pid, address)
        adopted, _, refused = self.replication.adopt(holder)
        return {"adopted": {str(s): v for s, v in adopted.items()}, "refused": refused, "own": sorted(holder.own)}

    def digest(self):
        return {"digest": digest_tensors(self.tensors)}

    def restate(self, version, seed):
        """Snapshot ``version`` again with other bytes (a re-run that diverged)."""
        self.store.native.drop_newer(version - 1)
        fill(self.tensors, seed, version)
        self.store.snapshot(version).wait()
        return {"digest": digest_tensors(self.tensors)}

    def largest_piece(self, version, group_size):
        pieces = peerstate._C.parity_pieces(self.store.native, version, group_size)
        return {"nbytes": max(nbytes for _first, _end, _offset, nbytes in pieces)}

    def hold_parity(self, members, block_bytes):
        self.replication.hold_parity(members, block_bytes)
        return {"held_bytes": self.replication.parity.held_bytes()}

    def push_pieces(self, version):
        self.replication.push_pieces(version)
        return {}

    def parity(self, version=-1):
        held, block = self.replication.parity.block(version)
        return {"committed": self.replication.parity.committed(), "version": held,
                "digest": hashlib.sha256(block).hexdigest()}

    def rebuild_piece(self, lost, version):
        self.replication.rebuild_piece(lost, version)
        return {"held_bytes": self.replication.parity.held_bytes()}

    def pull_pieces(self, rank, version):
        pulled = self.replication.pull_pieces(rank, version)
        self.store.restore(pulled, verify=False)
        return {"version": pulled, "digest": digest_tensors(self.tensors)}


def main():
    from peerstate.replication.stopped_holder import permit_reads_by_the_node

    permit_reads_by_the_node()  # as a worker does: its siblings read it (its replacement, a same-node puller)
    peer = Peer()
    for line in sys.stdin:
        request = json.loads(line)
        command = request.pop("cmd")
        if command == "exit":
            break
        try:
            reply = {"ok": True, **getattr(peer, command)(**request)}
        except Exception as e:  # reported to the test, which decides
            reply = {"ok": False, "error": type(e).__name__, "message": str(e), "trace": traceback.format_exc()}
        print(json.dumps(reply), flush=True)
    if peer.replication is not None:
        peer.replication.close()


if __name__ == "__main__":
    main()
