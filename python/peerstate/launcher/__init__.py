"""``peerstate run``: the node agent, its worker processes, fault injection."""
