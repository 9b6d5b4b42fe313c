"""The controller: GradScaler, its state (host and device forms, checkpoints), the per-optimizer
record of one iteration, and torch's private names as a compatibility layer over that state."""
