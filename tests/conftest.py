"""Test set-up: Triton kernels run on CPU tensors through the interpreter.

TRITON_INTERPRET must be set before triton is imported (the @triton.jit decorator decides at
import time), so it is set here, before anything imports tritonscale. Compile-only tests run in a
subprocess without it (tests/test_compile_targets.py). On a GPU machine the GPU tier runs with the
compiled kernels: ``TRITON_INTERPRET=0 pytest -m gpu``.

The suite runs on one worker process per CPU (pytest-xdist, ``-n auto --dist loadgroup`` in
pyproject.toml; ``-n 0`` runs it in this process). What makes that safe, and needs nothing of a new
test: every test that shares a fixture wider than a function with others lands with them on one
worker (``pytest_collection_modifyitems`` below groups them, so a module fixture that starts ranks
or compiles every kernel runs once); each worker has its own ``tmp_path`` tree, Dynamo state and
torch threads (one CPU's worth each, ``pytest_configure``); ranks rendezvous through a file in their
own temporary folder and gloo and torchrun bind free ports (tests/support/multiprocess.py; no test names a
port); Triton's and hypothesis's caches take concurrent writers (each writes a temporary file and
renames it). docs/testing.md, "Running the tests", has the tiers.
"""

import inspect
import os
import types

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence triton 3.9's default-change warning

import pytest  # noqa: E402
import torch  # noqa: E402
from support.host_reads import HostReadGuard  # noqa: E402

from tritonscale.kernels import TRITON_FOUND  # noqa: E402
from tritonscale.passes.backends import BACKENDS as BACKEND_CHOICES  # noqa: E402

# Every concrete backend ("auto" picks one of them); without triton installed (a CPU install, where
# the tests that need no interpreter still run) only torch's.
BACKENDS = [name for name in BACKEND_CHOICES if name != "auto" and (TRITON_FOUND or name != "triton")]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def forbid_host_reads(monkeypatch):
    """Make every Tensor->host read raise while the fixture's flag is on.

    On the CPU a few paths read values where that waits for nothing (``host_reads.are_free``: a
    rank mismatch raised at once, the torch backend's norm fallback); here they take the paths they
    take on a GPU instead, which must read nothing."""
    from tritonscale import host_reads

    monkeypatch.setattr(host_reads, "are_free", lambda device: False)
    return HostReadGuard(monkeypatch.setattr)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = shared_fixture_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        if starts_processes(item):
            item.add_marker(pytest.mark.slow)
    # The GPU tier runs compiled kernels on a real device; everything else runs anywhere.
    if torch.cuda.is_available() and os.environ["TRITON_INTERPRET"] == "0":
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm GPU and TRITON_INTERPRET=0")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def cpus() -> int:
    """The CPUs this process may run on (its affinity, which a container or ``taskset`` narrows;
    psutil's count, xdist's default, is the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def pytest_xdist_auto_num_workers(config):
    # ``-n auto``: one worker per CPU this process may use (PYTEST_XDIST_AUTO_NUM_WORKERS overrides).
    return int(os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS") or cpus())


def pytest_configure(config):
    # Each xdist worker gets its share of the CPUs for torch's intra-op threads: two workers of two
    # threads on two cores would each wait on the other's threads.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, cpus() // workers))
    if os.environ.get("PYTEST_XDIST_WORKER") and config.getvalue("loadgroup"):
        config.pluginmanager.register(WorkerOrder(), "tritonscale-worker-order")


class WorkerOrder:
    """On an xdist worker, what the scheduler reads from the collection: the groups, and the
    process-starting tests first (the longest, scheduled before the short ones fill the tail)."""

    @pytest.hookimpl(trylast=True)  # after deselection (-k, -m, --deselect) and fixture reordering
    def pytest_collection_modifyitems(self, config, items):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: files stay in order
        for item in items:
            groups = sorted({str(mark.args[0]) for mark in item.iter_markers("xdist_group")})
            if groups and not item.nodeid.endswith("@" + "_".join(groups)):
                join_group(item, "_".join(groups))


def join_group(item, group: str) -> None:
    """Tell xdist's loadgroup scheduler the test's group: the suffix ``@group`` on its nodeid.
    pytest-xdist 3.8 writes it to ``item._nodeid``, which pytest 9.2 no longer reads (it keeps a
    structured ``item._id``; pytest-xdist issue #1386): the groups were silently ignored."""
    nodeid = f"{item.nodeid}@{group}"
    if isinstance(getattr(item, "_id", None), str) or not hasattr(item, "_id"):
        item._nodeid = nodeid  # pytest before 9.2
    else:
        item._id = type(item._id).parse(nodeid)


def shared_fixture_group(item) -> str | None:
    """The xdist group of a test that uses a fixture of this suite wider than a function: its
    module's for a module- or class-scoped fixture, the fixture's own for a package or session one.
    None for a test whose fixtures are all per-test (or pytest's and plugins')."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    group = None
    for defs in info.name2fixturedefs.values():
        fixture = defs[-1]
        if fixture.scope == "function" or _code_in_tests(fixture.func) is None:
            continue
        if fixture.scope in ("package", "session"):
            return f"{fixture.argname} ({fixture.scope} fixture)"
        group = item.nodeid.split("::")[0]
    return group


TESTS = os.path.dirname(os.path.abspath(__file__))


def _code_in_tests(function) -> types.CodeType | None:
    """The code of a function defined under tests/ (None for pytest's, a plugin's or a builtin)."""
    code = getattr(inspect.unwrap(getattr(function, "__func__", function)), "__code__", None)
    return code if code is not None and code.co_filename.startswith(TESTS + os.sep) else None


#: A name that, in a test's code, in its fixtures' or in the functions of tests/ they call, means
#: the test starts processes: torch.distributed ranks (tests/support/multiprocess.py) or a subprocess.
PROCESS_STARTERS = frozenset({"run_ranks", "subprocess"})
_starts: dict[types.CodeType, bool] = {}


def starts_processes(item) -> bool:
    """Whether the test starts processes (then it is marked ``slow``): its function or one of its
    fixtures names a process starter, there or in a function of tests/ it names (followed through
    the module's globals). A static reading: a branch never taken counts too."""
    info = getattr(item, "_fixtureinfo", None)
    fixtures = [defs[-1].func for defs in info.name2fixturedefs.values()] if info else []
    return any(_names_a_starter(function) for function in [getattr(item, "function", None), *fixtures])


def _names_a_starter(function) -> bool:
    code = _code_in_tests(function)
    if code is None:
        return False
    function = inspect.unwrap(getattr(function, "__func__", function))
    if code not in _starts:
        _starts[code] = False  # a cycle of calls answers from the rest of the cycle
        names, codes = set(), [code]
        while codes:  # the function's own names and those of the functions and lambdas inside it
            inner = codes.pop()
            names.update(inner.co_names)
            codes.extend(const for const in inner.co_consts if isinstance(const, types.CodeType))
        called = (function.__globals__.get(name) for name in names)
        _starts[code] = bool(names & PROCESS_STARTERS) or any(
            _names_a_starter(callee) for callee in called if inspect.isfunction(callee)
        )
    return _starts[code]
