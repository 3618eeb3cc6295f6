"""Where state is copied to and how: buddy placement, data-parallel shares, the
replication endpoint (one native server and transport per rank), nccl."""
