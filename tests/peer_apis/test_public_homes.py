"""The checkpoint importers and the Updater at their short public home, ``tritonscale.from_megatron``
and the others."""

from __future__ import annotations


import tritonscale
from tritonscale.peer_apis import checkpoint_import, step_updater


def test_the_checkpoint_importers_have_a_short_public_home():
    for name in ("from_megatron", "from_deepspeed", "from_apex"):
        assert getattr(tritonscale, name) is getattr(checkpoint_import, name)
        assert name in tritonscale.__all__
    assert tritonscale.Updater is step_updater.Updater
