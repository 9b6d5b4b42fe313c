"""tests/conftest.py's collection rules, which keep the parallel run safe and the tiers honest.

A test that starts processes is marked ``slow`` without marking it by hand (``pytest -m "not
slow"`` leaves it out), and tests sharing a fixture wider than a function land on one xdist worker
(the fixture runs once). Both are read from the code at collection, so a new test needs no mark.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import conftest
import pytest


def _run_a_script():
    return subprocess.run([sys.executable, "-c", "pass"], check=True)


def _calls_a_helper_that_runs_a_script():
    return _run_a_script()


def _imports_the_ranks_inside():
    from support.multiprocess import run_ranks

    return run_ranks


def _ping():
    return _pong()


def _pong():
    return _ping() if False else 0  # a cycle of calls that starts nothing


def _plain():
    return sum(range(3))


def _item(function, fixtures=(), nodeid="tests/test_x.py::test_x"):
    defs = {fixture.argname: [fixture] for fixture in fixtures}
    return SimpleNamespace(function=function, nodeid=nodeid, _fixtureinfo=SimpleNamespace(name2fixturedefs=defs))


def _fixture(func, scope="function", argname="made"):
    return SimpleNamespace(func=func, scope=scope, argname=argname)


@pytest.mark.parametrize(
    "function, starts",
    [
        (_run_a_script, True),
        (_calls_a_helper_that_runs_a_script, True),  # through a function of tests/ it calls
        (_imports_the_ranks_inside, True),  # tests/support/multiprocess.py's ranks, imported in the body
        (lambda: _calls_a_helper_that_runs_a_script(), True),
        (_ping, False),
        (_plain, False),
        (sys.exit, False),  # not a function of tests/
    ],
    ids=["subprocess", "through-a-helper", "run_ranks-imported-inside", "lambda", "cycle", "plain", "builtin"],
)
def test_a_test_that_starts_processes_is_found(function, starts):
    assert conftest.starts_processes(_item(function)) is starts


def test_a_fixture_that_starts_processes_makes_its_tests_slow():
    assert conftest.starts_processes(_item(_plain, [_fixture(_calls_a_helper_that_runs_a_script, "module")]))
    assert not conftest.starts_processes(_item(_plain, [_fixture(_plain, "module")]))


def test_tests_sharing_a_wider_fixture_form_one_group():
    module = _fixture(_plain, "module")
    assert conftest.shared_fixture_group(_item(_plain, [module], "tests/a/test_y.py::test_z[1]")) == "tests/a/test_y.py"
    assert conftest.shared_fixture_group(_item(_plain, [_fixture(_plain, "class")], "tests/t.py::C::test")) == "tests/t.py"
    session = _fixture(_plain, "session", "built")
    assert conftest.shared_fixture_group(_item(_plain, [module, session])) == "built (session fixture)"
    assert conftest.shared_fixture_group(_item(_plain, [_fixture(_plain)])) is None  # per-test only
    assert conftest.shared_fixture_group(_item(_plain, [_fixture(sys.exit, "session")])) is None  # not ours


def test_this_session_marks_and_groups_the_process_tiers(request):
    """The rules applied to the tests collected with this one: what they found is on the items, and
    on an xdist worker the scheduler reads each group from the nodeid (pytest-xdist issue #1386:
    with pytest 9.2 it silently lost them)."""
    on_a_worker = os.environ.get("PYTEST_XDIST_WORKER") and request.config.getvalue("loadgroup")
    for item in request.session.items:
        assert (item.get_closest_marker("slow") is not None) >= conftest.starts_processes(item), item.nodeid
        group = conftest.shared_fixture_group(item)
        marks = sorted(str(mark.args[0]) for mark in item.iter_markers("xdist_group"))
        assert group is None or group in marks, item.nodeid
        if on_a_worker and marks:
            assert item.nodeid.endswith("@" + "_".join(marks)), item.nodeid


def test_auto_workers_are_the_cpus_this_process_may_use(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    assert conftest.pytest_xdist_auto_num_workers(None) == conftest.cpus() >= 1
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")
    assert conftest.pytest_xdist_auto_num_workers(None) == 3
