"""Every module a user imports names its public surface in ``__all__``: ``dir()`` and star-imports
show what the module offers, not what it imported (``dir(tritonscale.presets)`` listed ``Any``,
``Callable``, ``re``, ``dataclass``)."""

from __future__ import annotations

import importlib
import inspect

import pytest

import tritonscale

#: The modules the docs tell users to import; the integrations whose framework is not installed
#: here are skipped by name.
PUBLIC_MODULES = [
    "tritonscale",
    "tritonscale.presets",
    "tritonscale.integrations.lightning",
    "tritonscale.integrations.accelerate",
    "tritonscale.integrations.mmengine",
    "tritonscale.integrations.timm",
    "tritonscale.integrations.cpu_precision",
]


def load(name: str):
    if name == "tritonscale.presets":
        return tritonscale.presets
    try:
        return importlib.import_module(name)
    except ImportError as error:  # an integration whose framework is absent (timm needs torchvision)
        pytest.skip(f"{name}: {error}")


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_all_lists_what_the_module_defines_and_nothing_it_imported(name):
    module = load(name)
    assert hasattr(module, "__all__"), f"{name} has no __all__"
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert missing == [], f"{name}.__all__ names what it does not have: {missing}"
    defined_here = [
        n
        for n, obj in vars(module).items()
        if not n.startswith("_")
        and (inspect.isclass(obj) or inspect.isfunction(obj))
        and obj.__module__ == module.__name__
    ]
    assert sorted(set(defined_here) - set(module.__all__)) == [], f"{name} defines public names not in __all__"
    imported = [n for n in module.__all__ if inspect.ismodule(getattr(module, n)) and n != "presets"]
    assert imported == [], f"{name}.__all__ lists modules: {imported}"
