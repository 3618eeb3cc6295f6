"""Every key the control plane keeps in the job's KeyValueStore, spelled here once.
No key holds anything that grants access: the job secret is never in a store, nor
any private key (a certificate is public: it is useless without its key).

A leaf module (it imports nothing of peerstate), so any plane may name a key.
The families, with who writes and who reads them:

Job (written once, read by everyone)
    ``config``                      the job's shape; the first agent sets it, the others must agree
    ``nodes_joined``                counter of the agents that connected
    ``job/started``                 wall-clock time of the first step (first worker wins)
    ``job/finished``                counter of the ranks that finished the loop
    ``job/failed``                  why the job stops; the first reason wins

Nodes (each agent writes its own; its ring predecessors read them, see ``control.leases``)
    ``node/{n}/lease``              counter an agent bumps while it lives
    ``node/{n}/dead``               set once node n is declared lost (compare_set: one declarer)
    ``node/{n}/done``               set once node n's agent saw every rank finish
    ``nodes/dead``                  "n,n,..." the lost nodes, appended by each one's declarer

Spares
    ``spares``                      "id,id,..." every spare that ever registered (appended)
    ``spare/{worker}``              ready | gone | assigned:{epoch}:{rank}
    ``spares/wanted``               counter a plan writer bumps when it waits for a spare

Epochs (one plan writer per epoch; each node's agent writes its node's entry)
    ``epoch/{e}/owner``             the plan writer that won epoch e (compare_set)
    ``epoch/{e}/plan``              its RecoveryPlan (what changed: the replaced ranks)
    ``epoch/{e}/node/{n}/report``   node n's NodeReport: its members' MemberReports
    ``epoch/{e}/node/{n}/orders``   node n's NodeInstructions, written by the plan writer
    ``epoch/{e}/ddp/{index}``       the DDP bucket layout survivors settled on (one per node; the first wins)
    ``epoch/{e}/node/{n}/marks``    node n's members' recovery timeline marks, forwarded by its agent
    ``epoch/{e}/marks_done``        counter of the members whose marks were forwarded
    ``pg/{e}/...``                  torch's own keys of epoch e's process group (a PrefixStore)

Per rank
    ``bytes/{rank}``                bytes of one version of a rank's own state (its holders reserve them)
    ``errors/{rank}/{step}``        counter of the rank's workers whose script raised its own error in step

Node channel (a second store, hosted by each agent on loopback for its own
workers: they never read the job's store for the recovery protocol)
    ``epoch/{e}/plan``              the agent's copy of the epoch's plan (workers' watchers wait on it,
                                    and a waiting spare reads its assignment in it)
    ``certificate/{worker}/{rank}`` the job's certificate of ``rank`` for a spare of this node, set by its
                                    agent before the plan that gives the rank is copied in
    ``job/failed``                  the agent's copy of the job's failure, once its watch sees it
    ``epoch/{e}/report/{rank}``     a member's MemberReport, for its agent to gather
    ``epoch/{e}/orders/{n}``        the node's NodeInstructions, as the plan writer wrote them
    ``epoch/{e}/marks/{rank}``      a member's recovery timeline marks, after its first step (the agent
                                    forwards the node's together)
    ``stopped/{rank}``              "{pid}:{index address}" of the rank's hung worker, frozen for its replacement
    ``released/{pid}``              set by that replacement once it no longer reads it (then it is killed)
    ``findings``                    counter of what this node's workers found that is not bitwise
    ``finding/{n}``                 finding n: its rank, worker, step and cause (``control.findings``)
    ``rendezvous/{read}``           what a member read from the job's store for the process groups'
                                    rendezvous, for the node's other members (``control.node_rendezvous``;
                                    ``read`` is the key, or a digest of the keys read together)
    ``rendezvous/claim/{read}``     the member reading it for the node (compare_set; given back if it fails);
                                    both removed by that member once the epoch's groups are gone

Tools
    ``inject/{index}``              the agent that injected fault ``index`` (injected once)
    ``peerstate/nccl_id``           the NCCL unique id of the state transport
"""

CONFIG = "config"
NODES_JOINED = "nodes_joined"
JOB_STARTED = "job/started"
JOB_FINISHED = "job/finished"
JOB_FAILED = "job/failed"
SPARES = "spares"
SPARES_WANTED = "spares/wanted"
NCCL_ID = "peerstate/nccl_id"
DEAD_NODES = "nodes/dead"


def node_lease(node: int) -> str:
    return f"node/{node}/lease"


def node_dead(node: int) -> str:
    return f"node/{node}/dead"


def node_done(node: int) -> str:
    return f"node/{node}/done"


def spare_state(worker: str) -> str:
    return f"spare/{worker}"


def epoch_owner(epoch: int) -> str:
    return f"epoch/{epoch}/owner"


def epoch_plan(epoch: int) -> str:
    return f"epoch/{epoch}/plan"


def member_report(epoch: int, rank: int) -> str:
    return f"epoch/{epoch}/report/{rank}"


def node_report(epoch: int, node: int) -> str:
    return f"epoch/{epoch}/node/{node}/report"


def node_instructions(epoch: int, node: int) -> str:
    return f"epoch/{epoch}/node/{node}/orders"


# The value of a node_instructions key once a newer epoch made that one moot: the writer of the
# newer plan sets it for every node, so that a relay waiting there moves on at once.
MOOT = b"moot"


def member_instructions(epoch: int, node: int) -> str:
    """In the node channel: node ``node``'s instructions, which its members expand."""
    return f"epoch/{epoch}/orders/{node}"


def rank_certificate(worker: str, rank: int) -> str:
    """In the node channel: the certificate of ``rank`` for spare ``worker``."""
    return f"certificate/{worker}/{rank}"


def ddp_layout(epoch: int, index: int) -> str:
    return f"epoch/{epoch}/ddp/{index}"


def recovery_marks(epoch: int, rank: int) -> str:
    return f"epoch/{epoch}/marks/{rank}"


def node_marks(epoch: int, node: int) -> str:
    return f"epoch/{epoch}/node/{node}/marks"


def marks_done(epoch: int) -> str:
    return f"epoch/{epoch}/marks_done"


def collective_timeouts(epoch: int) -> str:
    """The ranks whose gloo collective timed out in epoch ``epoch`` ("r,r,..."): the others kept them waiting."""
    return f"epoch/{epoch}/timed_out"


def recovery_seconds(epoch: int) -> str:
    """Epoch ``epoch``'s recovery, from the fault to its first step's end (the job's lost time)."""
    return f"epoch/{epoch}/recovery_s"


def process_group_prefix(epoch: int) -> str:
    return f"pg/{epoch}/"


def rendezvous_read(read: str) -> str:
    """In the node channel: the values of a rendezvous read, for the node's other members."""
    return f"rendezvous/{read}"


def rendezvous_claim(read: str) -> str:
    """In the node channel: which member of the node makes that read in the job's store."""
    return f"rendezvous/claim/{read}"


# The disk checkpoint a new job resumes from, as the first member to look found it ("" for none).
RESUME = "job/resume"


def replica_bytes(rank: int) -> str:
    return f"bytes/{rank}"


def script_errors(rank: int, step: int) -> str:
    return f"errors/{rank}/{step}"


def injected(index: int) -> str:
    return f"inject/{index}"


def stopped_holder(rank: int) -> str:
    return f"stopped/{rank}"


def stopped_holder_released(pid: int) -> str:
    return f"released/{pid}"


FINDINGS = "findings"


def finding(index: int) -> str:
    return f"finding/{index}"
