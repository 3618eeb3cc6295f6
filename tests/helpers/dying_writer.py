"""A simulated node whose agent is killed (SIGKILL, by itself) when it has gathered
an epoch's node reports and before it publishes the instructions; until then it
bumps its lease like an agent. Used by tests/control/test_recovery_protocol.py.

Run: dying_writer.py STORE NNODES NODE NPROC (prints "ready", then "relayed")."""

import os
import signal
import sys
import time

from peerstate.control import keys
from peerstate.control.messages import StateLayout
from peerstate.tools.simulation import SimulatedNode, served_by

address, nnodes, node, nproc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
layout = StateLayout(k=1, share_count=nproc, data_parallel=True)  # as the test's other nodes
simulated = SimulatedNode(address, node, nnodes, nproc, served_by(nnodes * nproc, nproc, 1), layout=layout)
gathered = simulated.writer.instructions


def die_before_publishing(plan, reports):
    if plan.epoch > 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return gathered(plan, reports)


simulated.writer.instructions = die_before_publishing
simulated.connect()
simulated.start()
print("ready", flush=True)
simulated.channel.wait_delivered(0, 30)
print("relayed", flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    simulated.kv.add(keys.node_lease(node), 1)
    time.sleep(0.1)
