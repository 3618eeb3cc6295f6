"""The control plane: the key-value store and its one key schema, the messages,
the pure recovery decisions, the coordinator, the agent-to-worker contract,
progress counters and event logs."""
