"""The loss-scale policy: its knobs and their checks, the backoff/growth rule, and how the rule
runs (one Triton kernel where kernels launch, the same rule in tensor ops elsewhere)."""
