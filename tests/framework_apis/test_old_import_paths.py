"""The 0.2 import paths of documented public names still work: ``tritonscale.shapes`` (now
``tritonscale.framework_apis``) with a DeprecationWarning, each module the same object, and the
checkpoint importers at their short public home, ``tritonscale.from_megatron`` and the others."""

from __future__ import annotations

import subprocess
import sys

import tritonscale
from tritonscale.framework_apis import checkpoint_import, step_updater


def test_the_old_package_path_warns_and_gives_the_same_objects():
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    from tritonscale.shapes.checkpoint_import import from_megatron\n"
        "    from tritonscale.shapes import step_updater\n"
        "import tritonscale\n"
        "assert from_megatron is tritonscale.from_megatron\n"
        "assert step_updater.Updater is tritonscale.Updater\n"
        "assert [w.category for w in caught] == [DeprecationWarning], caught\n"
        "assert 'tritonscale.framework_apis' in str(caught[0].message)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_checkpoint_importers_have_a_short_public_home():
    for name in ("from_megatron", "from_deepspeed", "from_apex"):
        assert getattr(tritonscale, name) is getattr(checkpoint_import, name)
        assert name in tritonscale.__all__
    assert tritonscale.Updater is step_updater.Updater


def test_the_old_sharding_module_path_warns_once_and_is_the_same_module():
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    from tritonscale.grads.grad_sharding import mark_replicated\n"
        "    import tritonscale.grads.grad_sharding as old\n"
        "import tritonscale\n"
        "import tritonscale.grads.sharding as new\n"
        "assert mark_replicated is tritonscale.mark_replicated\n"
        "assert old is new\n"
        "assert [w.category for w in caught] == [DeprecationWarning], caught\n"
        "assert 'tritonscale.grads.sharding' in str(caught[0].message)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
