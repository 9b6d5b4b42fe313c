"""The loss-scale policy: its knobs and their checks, the backoff/growth rule, and how the rule
runs (on Python numbers where reads are free, as device ops elsewhere)."""
