"""The loop around the scaler: what a training loop does with each step's outcome, on the device.

After ``scaler.update()`` a loop advances its learning-rate schedule (only on applied steps), logs
the scale, the norm and the skips, and may skip or clip on norm spikes. Each of these reads the
step's outcome from the controller's public API (``last_skip_flag()``, ``stats()``) as device
values, so none of them waits on the device. This stage comes after the controller and before the
peer APIs and integrations, which may use it.
"""
