"""The elastic driver: rank assignment, registry, rendezvous, notifications, launchers."""
