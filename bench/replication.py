"""Replication throughput on loopback beside plain TCP of the same bytes.

Push: a rank's committed version to one holder (replicate + wait), with 1, 2
and 4 connections. Pull: a fresh rank fetches that state from one and two
holders into its store (every chunk verified on arrival); recover: what a
replacement does, ``recover()``: the pull, then ``restore()`` into its tensors
without a second checksum pass. The fresh rank's store memory is allocated
beforehand, as a hot spare's would be. The limit,
measured in the same run, is plain TCP over loopback with the same number of
connections: ``socket.sendall`` / ``recv_into`` of the same bytes, no
handshake, no checksums, no bookkeeping. Everything runs in one process on
the same cores, as both ends of a real transfer would share a node's CPUs
here. Every case runs with each frame protection (``--protections``): the
default ``authenticated`` (an AES-256-GCM tag on every frame), ``encrypted``
and ``trusted-fabric`` (no per-frame protection), so the cost of each is
measured in the same run, as throughput and as CPU-seconds per GB (both ends)
beside plain TCP's and beside the protection's own passes at one core's rate,
a cost that holds on any machine. Beside them, TLS 1.3 streams of the same
bytes (Python's ``ssl``, OpenSSL's record layer; ``--no-tls`` leaves them out):
what replacing our frames with the standard protocol would cost (issue #39).
Prints a table; writes ``bench/results/replication.json``.

    python bench/replication.py            # 256 MiB and 1 GiB of state
    python bench/replication.py --quick    # 256 MiB only
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import secrets
import socket
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

import peerstate
from peerstate import _C, _probes

MiB = 1 << 20


def plain_tcp_GBps(payload: memoryview, connections: int, repeats: int, tls: "TlsPair" = None) -> tuple:
    """Best rate of moving `payload` over `connections` loopback TCP streams, and the
    CPU-seconds per GB (both ends, every thread of this process) of that best round.
    With `tls`, each stream is a TLS 1.3 connection (handshake before the timing)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(connections)
    port = listener.getsockname()[1]
    senders = [socket.create_connection(("127.0.0.1", port)) for _ in range(connections)]
    receivers = [listener.accept()[0] for _ in range(connections)]
    if tls is not None:
        senders, receivers = tls.wrap(senders, receivers)
    sink = bytearray(len(payload))
    share = (len(payload) + connections - 1) // connections
    best = float("inf")
    try:
        for _ in range(repeats):
            def send(i):
                senders[i].sendall(payload[i * share:(i + 1) * share])

            def receive(i):
                view = memoryview(sink)[i * share:min(len(payload), (i + 1) * share)]
                while len(view):
                    n = receivers[i].recv_into(view)
                    view = view[n:]

            threads = [threading.Thread(target=f, args=(i,)) for i in range(connections) for f in (send, receive)]
            start, cpu = time.perf_counter(), time.process_time()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if time.perf_counter() - start < best:
                best, best_cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        for s in senders + receivers + [listener]:
            s.close()
    return len(payload) / best / 1e9, best_cpu / (len(payload) / 1e9)


class TlsPair:
    """TLS 1.3 for both ends of the plain-TCP baseline (Python's ``ssl``: OpenSSL's
    record layer, the library our protection uses too), under a throwaway
    self-signed certificate made with the ``openssl`` command. What issue #39 asks
    to weigh: a standard protocol in place of our own frames. Its cost is the
    record layer's; the handshake (certificate here, an external PSK in a real
    deployment) is outside the timing."""

    def __init__(self, directory: Path) -> None:
        import ssl
        import subprocess

        key, cert = directory / "key.pem", directory / "cert.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True)
        self.server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.server.load_cert_chain(cert, key)
        self.client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        self.client.load_verify_locations(cert)
        for context in (self.server, self.client):
            context.minimum_version = ssl.TLSVersion.TLSv1_3
        self.cipher = None

    def wrap(self, senders: list, receivers: list) -> tuple:
        wrapped = {}

        def server(i: int) -> None:
            wrapped[("r", i)] = self.server.wrap_socket(receivers[i], server_side=True)

        threads = [threading.Thread(target=server, args=(i,)) for i in range(len(receivers))]
        for t in threads:
            t.start()
        clients = [self.client.wrap_socket(s, server_hostname="127.0.0.1") for s in senders]
        for t in threads:
            t.join()
        self.cipher = clients[0].cipher()[0]
        return clients, [wrapped[("r", i)] for i in range(len(receivers))]


def tls_rows(size_mib: int, repeats: int, tls: TlsPair) -> list:
    """TLS 1.3 streams of the same bytes, beside plain TCP in the same run."""
    payload = torch.randint(0, 256, (size_mib * MiB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    rows = []
    for connections in (1, 4):
        plain, plain_cpu = plain_tcp_GBps(memoryview(payload.numpy()), connections, repeats)
        rate, cpu = plain_tcp_GBps(memoryview(payload.numpy()), connections, repeats, tls=tls)
        rows.append(dict(case=f"stream {size_mib}MiB x{connections} conn", protection=f"TLS 1.3 ({tls.cipher})",
                         ours_GBps=rate, limit_GBps=plain, ratio=rate / plain, ours_cpu_s_per_GB=cpu,
                         limit_cpu_s_per_GB=plain_cpu, protection_cpu_s_per_GB=None, ceiling=None))
    return rows


def ceiling(protection: str, plain_GBps: float, plain_cpu_per_GB: float, tag_GBps: dict) -> float:
    """The most a protected transfer can reach against plain TCP when both ends share this
    machine's cores and plain TCP already keeps them busy: each GB costs plain TCP's CPU
    plus the protection's pass over the payload at both ends (one core's rate, measured in
    the same run), nothing else counted (our checksums and bookkeeping make the true
    ceiling lower). 1.0 for no protection."""
    if protection not in tag_GBps:
        return 1.0
    cores = _probes.available_cores()
    best_GBps = cores / (plain_cpu_per_GB + 2 / tag_GBps[protection])
    return min(1.0, best_GBps / plain_GBps)


class Rank:
    def __init__(self, rank, placement, job, nbytes, connections, fill, protection):
        self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        if fill:
            self.tensor.random_(0, 256, generator=torch.Generator().manual_seed(rank))
        else:
            self.tensor.zero_()
        self.store = peerstate.SnapshotStore()
        self.store.register("state", self.tensor)
        self.repl = peerstate.Replication(self.store, rank, placement, credentials=job.issue(rank),
                                          connections_per_peer=connections, io_timeout=120, protection=protection)

    def close(self):
        self.repl.close()
        self.store.close()


def protection_cpu(protection: str, tag_GBps: dict) -> float:
    """CPU-seconds per GB of the protection's own passes: sealing at one end, opening
    at the other, each at one core's rate of the same library (0 for trusted-fabric)."""
    return 2 / tag_GBps[protection] if protection in tag_GBps else 0.0


def run(size_mib: int, repeats: int, protection: str, tag_GBps: dict) -> list:
    nbytes = size_mib * MiB
    job = peerstate._C.JobAuthority(secrets.token_bytes(32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 3 ranks on 3 "nodes" of one machine
        placement = peerstate.BuddyPlacement(["a", "b", "c"], k=2)
    rows = []
    for connections in (1, 2, 4):
        # Only rank 0's state is moved; the holders' own state is a token 4 KiB.
        ranks = [Rank(r, placement, job, nbytes if r == 0 else 4096, connections, fill=(r == 0),
                      protection=protection) for r in range(3)]
        try:
            addresses = {r: ranks[r].repl.address for r in range(3)}
            for r in ranks:
                r.repl.connect(addresses)
            size = ranks[0].store.memory()["bytes_per_version"]
            for holder in placement.holders(0):
                ranks[holder].repl.reserve({0: size})
            push, push_cpu = float("inf"), 0.0
            for version in range(1, repeats + 2):
                ranks[0].store.snapshot(version).wait()
                start, cpu = time.perf_counter(), time.process_time()
                ranks[0].repl.replicator.replicate(version, [placement.holders(0)[0]])  # one holder
                ranks[0].repl.wait(version)
                if version > 1 and time.perf_counter() - start < push:  # the first round also opens the connections
                    push, push_cpu = time.perf_counter() - start, time.process_time() - cpu
            limit, limit_cpu = plain_tcp_GBps(memoryview(ranks[0].tensor.numpy()), connections, repeats)
            most = ceiling(protection, limit, limit_cpu, tag_GBps)
            rows.append(dict(case=f"push {size_mib}MiB x{connections} conn", protection=protection,
                             ours_GBps=nbytes / push / 1e9, limit_GBps=limit, ratio=nbytes / push / 1e9 / limit,
                             ours_cpu_s_per_GB=push_cpu / (nbytes / 1e9), limit_cpu_s_per_GB=limit_cpu,
                             protection_cpu_s_per_GB=protection_cpu(protection, tag_GBps), ceiling=most))
            if connections == 4:
                ranks[0].store.snapshot(repeats + 2).wait()
                ranks[0].repl.replicate(repeats + 2)
                ranks[0].repl.wait(repeats + 2)  # now both holders have it
                for sources in ([1], [1, 2]):
                    best = {"pull": (float("inf"), 0.0), "recover": (float("inf"), 0.0)}  # (seconds, CPU seconds)
                    for _ in range(repeats):
                        for what in ("pull", "recover"):
                            fresh = Rank(0, placement, job, nbytes, connections, fill=False,
                                         protection=protection)
                            fresh.store.allocate()  # a hot spare's memory is ready before the failure
                            fresh.repl.connect(addresses)
                            start, cpu = time.perf_counter(), time.process_time()
                            if what == "pull":
                                fresh.repl.pull(0, sources=sources)
                            else:
                                fresh.repl.recover(0, sources=sources)
                            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
                            if seconds < best[what][0]:
                                best[what] = (seconds, cpu_seconds)
                            if what == "recover":
                                assert torch.equal(fresh.tensor, ranks[0].tensor)
                            fresh.close()
                            del fresh
                            gc.collect()
                    for what, (seconds, cpu_seconds) in best.items():
                        rows.append(dict(case=f"{what} {size_mib}MiB from {len(sources)} x{connections} conn",
                                         protection=protection, ours_GBps=nbytes / seconds / 1e9, limit_GBps=limit,
                                         ratio=nbytes / seconds / 1e9 / limit,
                                         ours_cpu_s_per_GB=cpu_seconds / (nbytes / 1e9), limit_cpu_s_per_GB=limit_cpu,
                                         protection_cpu_s_per_GB=protection_cpu(protection, tag_GBps), ceiling=most))
        finally:
            for r in ranks:
                r.close()
            del ranks
            gc.collect()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB only")
    parser.add_argument("--sizes", type=int, nargs="*", help="state sizes in MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--protections", nargs="+", default=["authenticated", "encrypted", "trusted-fabric"],
                        help="frame protections to measure, each in this run")
    parser.add_argument("--no-tls", action="store_true", help="leave out the TLS 1.3 streams (needs `openssl`)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "replication.json"))
    args = parser.parse_args(argv)
    sizes = args.sizes or ([256] if args.quick else [256, 1024])
    # One core's rate of each protection's pass over a payload, by the library the transport uses.
    tag_GBps = {p: _probes.frame_protection_throughput(p) / 1e9 for p in args.protections if p != "trusted-fabric"}
    print("one core: " + ", ".join(f"{p} {rate:.2f} GB/s" for p, rate in tag_GBps.items()), flush=True)
    rows = [row for size in sizes for protection in args.protections
            for row in run(size, args.repeats, protection, tag_GBps)]
    if not args.no_tls:
        import tempfile

        with tempfile.TemporaryDirectory() as directory:
            tls = TlsPair(Path(directory))
            rows += [row for size in sizes for row in tls_rows(size, args.repeats, tls)]
    # Each protection beside trusted-fabric (no per-frame protection), same case, same run.
    bare = {r["case"]: r["ours_GBps"] for r in rows if r["protection"] == "trusted-fabric"}
    for r in rows:
        r["vs_trusted_fabric"] = r["ours_GBps"] / bare[r["case"]] if r["case"] in bare else None
    print(f"{'case':<34}{'protection':>16}{'ours GB/s':>11}{'plain TCP GB/s':>16}{'ratio':>8}{'ceiling':>9}"
          f"{'vs bare':>9}{'ours CPU s/GB':>15}{'plain':>7}{'prot.':>7}")
    for r in rows:
        versus = f"{r['vs_trusted_fabric']:>9.2f}" if r["vs_trusted_fabric"] is not None else f"{'-':>9}"
        most = f"{r['ceiling']:>9.2f}" if r["ceiling"] is not None else f"{'-':>9}"
        own = f"{r['protection_cpu_s_per_GB']:>7.2f}" if r["protection_cpu_s_per_GB"] is not None else f"{'-':>7}"
        print(f"{r['case']:<34}{r['protection']:>16}{r['ours_GBps']:>11.2f}{r['limit_GBps']:>16.2f}"
              f"{r['ratio']:>8.2f}{most}{versus}{r['ours_cpu_s_per_GB']:>15.2f}"
              f"{r['limit_cpu_s_per_GB']:>7.2f}{own}")
    print("ceiling: the most that protection can reach against plain TCP here, from plain TCP's own CPU per GB and "
          "the protection's pass over the payload at both ends (see ceiling()). CPU s/GB: both ends, every thread "
          "of this process (ours), plain TCP's of the same bytes (plain), and the protection's own two passes at one "
          "core's rate (prot.): ours - plain - prot. is what the transport itself costs, on any machine")
    result = dict(benchmark="replication",
                  command="python " + " ".join(["bench/replication.py", *(argv if argv is not None else sys.argv[1:])]),
                  machine=dict(cores=_probes.available_cores(), cpu=platform.processor() or platform.machine()),
                  repeats=args.repeats, one_core_protection_GBps=tag_GBps, rows=rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
