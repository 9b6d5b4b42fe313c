"""Every public function, method and property of tritonscale carries torch's Google-style sections:
``Args:`` naming each parameter (besides ``self``/``cls``), and ``Returns:`` where it returns something
other than ``None`` (by its annotation).

The walk covers the whole public API: every name in the ``__all__`` of each public module
(``PUBLIC_MODULES``), and every public method and property its classes define in tritonscale
(inherited ones included). An integration whose framework is not installed here is skipped."""

from __future__ import annotations

import inspect
import re

import pytest

from test_public_modules import PUBLIC_MODULES, load


def _defined_in_tritonscale(obj) -> bool:
    return (getattr(obj, "__module__", None) or "").startswith("tritonscale")


def _members(module, public: str):
    """``(qualified name, function, is_property)`` for each public function of ``module.__all__``, and
    each public method/property a public class defines in tritonscale (inherited ones included)."""
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isfunction(obj) and _defined_in_tritonscale(obj):
            yield f"{public}.{name}", obj, False
        elif inspect.isclass(obj) and _defined_in_tritonscale(obj):
            if not issubclass(obj, BaseException):
                yield f"{public}.{name}", obj, False  # the constructor's parameters
            for klass in obj.__mro__:
                if not _defined_in_tritonscale(klass):
                    continue
                for attr, raw in vars(klass).items():
                    if attr.startswith("_"):
                        continue
                    if isinstance(raw, property):
                        if raw.fget is not None:
                            yield f"{public}.{name}.{attr}", raw.fget, True
                    elif isinstance(raw, (staticmethod, classmethod)):
                        yield f"{public}.{name}.{attr}", raw.__func__, False
                    elif inspect.isfunction(raw):
                        yield f"{public}.{name}.{attr}", raw, False


def _parameters(obj) -> list[str]:
    target = obj.__init__ if inspect.isclass(obj) else obj
    if inspect.isclass(obj) and not _defined_in_tritonscale(target):
        return []  # e.g. a dataclass's generated __init__ is in the class's module; object.__init__ is not
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return []
    return [
        p.name.lstrip("*")
        for i, p in enumerate(signature.parameters.values())
        if not (i == 0 and p.name in ("self", "cls"))
    ]


def _returns_something(obj, is_property: bool) -> bool:
    if inspect.isclass(obj):
        return False
    if is_property:
        return True
    annotation = inspect.signature(obj).return_annotation
    return annotation not in (inspect.Signature.empty, None, "None")


def _args_section(doc: str) -> str:
    match = re.search(r"^\s*Args:\s*$(.*?)(?=^\s*(Returns|Yields|Raises|Example|Examples|Note|Notes):\s*$|\Z)", doc, re.M | re.S)
    return match.group(1) if match else ""


def _problems(qualname, obj, is_property) -> list[str]:
    doc = inspect.getdoc(obj.__init__ if inspect.isclass(obj) and obj.__init__.__doc__ and "Args:" in (obj.__init__.__doc__ or "") else obj) or ""
    problems = []
    params = [] if is_property else _parameters(obj)
    if params:
        section = _args_section(doc)
        if not section:
            problems.append(f"{qualname}: no Args: section (parameters {params})")
        else:
            missing = [p for p in params if not re.search(rf"^\s*\**{re.escape(p)}\b[^:\n]*:", section, re.M)]
            if missing:
                problems.append(f"{qualname}: Args: does not name {missing}")
    if _returns_something(obj, is_property) and not re.search(r"^\s*Returns:", doc, re.M):
        problems.append(f"{qualname}: no Returns: section")
    return problems


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_public_api_has_args_and_returns_sections(name):
    module = load(name)
    seen = set()
    problems = []
    for qualname, obj, is_property in _members(module, name):
        if qualname in seen:
            continue
        seen.add(qualname)
        problems += _problems(qualname, obj, is_property)
    assert problems == [], f"{len(problems)} undocumented:\n" + "\n".join(problems)
