"""Gradients in: which tensors an optimizer steps, grouped per (device, dtype), flat buffers and
their proof, and how sharded (DTensor) or replicated gradients count."""
