"""peerstate inside other trainers: each module subclasses a trainer's own entry
point, so that its users keep their trainer and its configuration."""
