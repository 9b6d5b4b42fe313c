"""Framework integrations: the framework's own clipping call routed to the fused pass.

One module per framework, each importing its framework when it is imported itself (never from
here), so ``import tritonscale`` needs none of them:

* ``tritonscale.integrations.lightning``  -- Lightning Trainer and Fabric precision plugins;
* ``tritonscale.integrations.accelerate`` -- Accelerate, and the Hugging Face Trainer on top of it;
* ``tritonscale.integrations.timm``       -- a drop-in for timm's ``NativeScaler``;
* ``tritonscale.integrations.mmengine``   -- an ``AmpOptimWrapper`` registered under its own name.

``pip install ".[integrations]"`` (from a clone) installs the frameworks the tests run against.
"""
