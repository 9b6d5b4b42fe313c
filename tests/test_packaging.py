"""Packaging: the wheel ships the kernels as ``tritonscale.kernels`` and nothing as ``kernels``.

The kernels are the subpackage ``tritonscale/kernels/``, listed in pyproject.toml's explicit
package list. A mistake there would leave them out of the wheel, or ship a top-level ``kernels``
package, which clashes with the unrelated PyPI project of that name (Hugging Face's ``kernels``,
which transformers>=5.25 installs beside us: the checks below ask who owns a ``kernels`` found,
not whether one exists); neither shows up in the in-tree test runs. The import checks run in subprocesses from a
neutral working directory, so that neither this test process (conftest has already imported
torch and set TRITON_INTERPRET) nor the repository root on ``sys.path`` can mask a problem.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
KERNEL_MODULES = ("check_pass.py", "apply_pass.py", "finalize.py")


def _clean_env() -> dict[str, str]:
    """The environment of a user's process: no interpreter mode forced by conftest."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return env


def _python(code: str, cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = _clean_env() if pythonpath is None else {**_clean_env(), "PYTHONPATH": str(pythonpath)}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=120,
    )


def _copy_tracked_files(dest: Path) -> None:
    """Copy the working-tree state of git's tracked files: the build never writes into REPO."""
    if shutil.which("git") is None:
        pytest.skip("git not available: cannot list the repository's tracked files")
    listing = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, text=True)
    if listing.returncode != 0:
        pytest.skip(f"not a git checkout: {listing.stderr.strip()}")
    for name in filter(None, listing.stdout.split("\0")):
        src = REPO / name
        if not src.is_file():  # tracked but deleted in the working tree
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A snapshot of the tracked files: what a fresh clone holds."""
    source = tmp_path_factory.mktemp("source")
    _copy_tracked_files(source)
    return source


@pytest.fixture(scope="module")
def wheel(checkout, tmp_path_factory) -> Iterator[tuple[zipfile.ZipFile, Path]]:
    """Build the wheel once from the snapshot of the tracked files; yield it and the snapshot."""
    source = checkout
    outdir = tmp_path_factory.mktemp("dist")
    build = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(outdir)],
        capture_output=True,
        text=True,
        cwd=source,
        timeout=300,
    )
    if build.returncode != 0:
        # `build` checks [build-system].requires against the environment and refuses when the
        # `wheel` distribution is not installed, although setuptools>=70.1 builds wheels itself.
        # pip performs no such check; --no-index keeps it offline.
        pip = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
             "--no-index", "--no-cache-dir", "-w", str(outdir), str(source)],
            capture_output=True,
            text=True,
            cwd=source,
            timeout=300,
        )  # fmt: skip
        assert pip.returncode == 0, (
            f"python -m build failed:\n{build.stdout[-2000:]}{build.stderr[-2000:]}\n"
            f"pip wheel failed too:\n{pip.stdout[-2000:]}{pip.stderr[-2000:]}"
        )
    wheels = list(outdir.glob("tritonscale-*.whl"))
    assert len(wheels) == 1, f"expected one wheel, found {wheels}"
    with zipfile.ZipFile(wheels[0]) as zf:
        yield zf, source


def test_wheel_ships_kernels_inside_the_package(wheel):
    zf, source = wheel
    names = set(zf.namelist())
    expected = {"tritonscale/__init__.py"} | {f"tritonscale/kernels/{m}" for m in KERNEL_MODULES}
    assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"
    # The wheel ships the checkout's kernels, file for file.
    for module in KERNEL_MODULES:
        shipped = zf.read(f"tritonscale/kernels/{module}")
        assert shipped == (source / "tritonscale" / "kernels" / module).read_bytes(), module


def test_wheel_has_no_top_level_kernels_package(wheel):
    zf, _ = wheel
    names = zf.namelist()
    assert not [n for n in names if n.startswith("kernels/")], "wheel ships a top-level kernels/"
    # Nothing besides the package and its metadata (no tests/, bench/ ...).
    top = {n.split("/", 1)[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"tritonscale"}, top


def test_wheel_top_level_txt_lists_only_tritonscale(wheel):
    zf, _ = wheel
    top_level = [n for n in zf.namelist() if n.endswith(".dist-info/top_level.txt")]
    if not top_level:
        pytest.skip("this setuptools writes no top_level.txt")
    listed = zf.read(top_level[0]).decode().split()
    assert "kernels" not in listed, listed
    assert listed == ["tritonscale"], listed


def test_installed_package_imports_kernels_as_subpackage(tmp_path):
    proc = _python("import tritonscale, tritonscale.kernels; print(tritonscale.kernels.__name__)", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["tritonscale.kernels"]


#: Prints where a top-level `kernels` would be imported from ('-' if nowhere), the distributions
#: that declare it, and the interpreter's site folder, without importing it (another project's
#: package may be heavy to import).
WHO_OWNS_KERNELS = (
    "import importlib.metadata, importlib.util, sysconfig\n"
    "spec = importlib.util.find_spec('kernels')\n"
    "print(spec.origin if spec is not None else '-')\n"
    "print(','.join(importlib.metadata.packages_distributions().get('kernels', [])) or '-')\n"
    "print(sysconfig.get_paths()['purelib'])\n"
)


def _assert_kernels_is_not_ours(output: str, tree: Path) -> None:
    origin, owners, site = output.split()
    assert "tritonscale" not in owners.split(","), f"tritonscale declares a top-level `kernels`: {owners}"
    # An editable install or a checkout on the path maps names into the tree itself: a `kernels`
    # found there, outside the installed distributions' site folder, is ours whatever the metadata says.
    if origin != "-" and not Path(origin).resolve().is_relative_to(Path(site).resolve()):
        assert not Path(origin).resolve().is_relative_to(tree.resolve()), f"`kernels` imports from {origin}"


def test_bare_kernels_is_not_ours(tmp_path):
    # From a neutral cwd only the installed distributions are on sys.path: ours must expose
    # tritonscale.kernels and nothing as `kernels` (another project's `kernels` may be there).
    proc = _python(WHO_OWNS_KERNELS, tmp_path)
    assert proc.returncode == 0, proc.stderr
    _assert_kernels_is_not_ours(proc.stdout, REPO)


def test_import_does_not_initialise_cuda(tmp_path):
    # torch.cuda._lazy_init is what every CUDA-touching torch call goes through; recording calls
    # to it keeps the check meaningful on CPU-only torch, where is_initialized() is always False.
    code = (
        "import torch, torch.cuda\n"
        "calls = []\n"
        "real = torch.cuda._lazy_init\n"
        "torch.cuda._lazy_init = lambda: (calls.append(1), real())[1]\n"
        "import tritonscale, tritonscale.kernels\n"
        "print(torch.cuda.is_initialized(), len(calls))\n"
    )
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "0"], proc.stdout


def test_torch_backend_step_runs_without_numpy(tmp_path):
    # numpy is not a dependency: Triton's interpreter needs it, plain CPU use must not.
    # (A fresh-clone run of the README's main job caught exactly this.)
    result = _python(
        "import sys; sys.modules['numpy'] = None\n"
        "import torch, tritonscale\n"
        "p = torch.nn.Parameter(torch.ones(4)); opt = torch.optim.SGD([p], lr=0.1)\n"
        "s = tritonscale.GradScaler('cpu'); s.scale(p.sum()).backward()\n"
        "print(float(s.clip_grad_norm_(opt, 1.0))); s.step(opt); s.update()\n",
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.split()[-1]) == 2.0  # |(1, 1, 1, 1)| after unscaling


def test_checkout_on_pythonpath_imports_its_own_kernels(checkout, tmp_path):
    # A clone put on PYTHONPATH (no install) must import tritonscale.kernels from itself, not
    # fail and not fall through to another copy (an editable install's finder maps the name too),
    # and must expose no top-level `kernels` package of its own.
    code = "import tritonscale.kernels\nprint(tritonscale.kernels.__file__)\n" + WHO_OWNS_KERNELS
    proc = _python(code, tmp_path, pythonpath=checkout)
    assert proc.returncode == 0, proc.stderr
    kernels_file, who_owns_kernels = proc.stdout.split("\n", 1)
    assert Path(kernels_file) == checkout / "tritonscale" / "kernels" / "__init__.py", kernels_file
    _assert_kernels_is_not_ours(who_owns_kernels, checkout)


#: The README's quickstart, run as a user's script: its first Python block.
QUICKSTART = (REPO / "README.md").read_text().split("```python\n", 1)[1].split("```", 1)[0]
#: A process with neither triton nor numpy (what a fresh venv holding only CPU torch has): each import fails.
WITHOUT_TRITON = "import sys\nsys.modules['triton'] = None\nsys.modules['numpy'] = None\n"
#: ... and then: the package, its kernels subpackage, the quickstart, and backend='triton' refused when built.
NO_TRITON_CHECKS = (
    "import tritonscale, tritonscale.kernels\n"
    "assert not tritonscale.kernels.TRITON_FOUND\n"
    + QUICKSTART
    + "assert scaler.get_scale() == 2.0**16 and bool(grad_norm.isfinite())\n"
    "try:\n"
    "    tritonscale.GradScaler('cpu', backend='triton')\n"
    "except ModuleNotFoundError as error:\n"
    "    print(error)\n"
)


def _assert_runs_without_triton(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr
    message = proc.stdout.strip()
    assert "GradScaler(backend='triton'): triton is not installed" in message, message
    assert "backend='torch'" in message and "pip install" in message, message


def test_checkout_imports_and_runs_the_quickstart_without_triton(checkout, tmp_path):
    # triton is no dependency (a CPU install runs torch's ops): a checkout on PYTHONPATH imports,
    # runs the quickstart, and refuses backend='triton' naming the install.
    _assert_runs_without_triton(_python(WITHOUT_TRITON + NO_TRITON_CHECKS, tmp_path, pythonpath=checkout))


def test_installed_wheel_imports_and_runs_the_quickstart_without_triton(wheel, tmp_path):
    # The built wheel, unpacked as pip installs it into a site folder of its own: only torch beside it.
    zf, _ = wheel
    site = tmp_path / "site"
    zf.extractall(site)
    _assert_runs_without_triton(_python(WITHOUT_TRITON + NO_TRITON_CHECKS, tmp_path, pythonpath=site))


#: Installed tritons that fail to import, as a broken install does: (the package's __init__, the error).
BROKEN_TRITONS = {
    "extension missing": ("from ._C.libtriton import ir\n", "No module named 'triton._C'"),
    "extension for another ABI": (
        "raise ImportError('libtriton.so: undefined symbol: _ZN4llvm5errsEv')\n", "undefined symbol"),
}  # fmt: skip


@pytest.mark.parametrize("broken", list(BROKEN_TRITONS))
def test_a_triton_that_fails_to_import_counts_as_no_triton_as_torch_counts_it(checkout, tmp_path, broken):
    # A triton package found on the path whose import raises: torch counts it as absent
    # (torch.utils._triton.has_triton_package), and so must we: the package imports, the quickstart
    # runs on torch's ops, and backend='triton' is refused naming triton's own error.
    init, error = BROKEN_TRITONS[broken]
    fake = tmp_path / "site"
    (fake / "triton").mkdir(parents=True)
    (fake / "triton" / "__init__.py").write_text(init)
    code = (
        "import importlib.util, torch.utils._triton\n"
        "assert importlib.util.find_spec('triton') is not None  # installed, as far as the path says\n"
        "assert not torch.utils._triton.has_triton_package()  # torch's verdict: no triton\n"
        + NO_TRITON_CHECKS.replace("except ModuleNotFoundError", "except ImportError")
    )
    proc = _python(code, tmp_path, pythonpath=f"{fake}{os.pathsep}{checkout}")
    assert proc.returncode == 0, proc.stderr
    message = proc.stdout.strip()
    assert "GradScaler(backend='triton'): triton is installed but fails to import" in message, message
    assert error in message and "backend='torch'" in message, message


def test_the_readme_main_job_installs_the_triton_its_stages_import():
    """The README's main job (``python bench/run_all.py``) compiles the kernels (kernel_report) and
    runs the Triton variants on the CPU's interpreter: the extras its command installs must bring
    triton, which is no dependency of the package (a CPU install without it ran every stage but
    kernel_report, which failed: ``No module named 'triton'``)."""
    import re

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = Path(__file__).resolve().parents[1]
    command = next(line for line in (root / "README.md").read_text().splitlines() if "bench/run_all.py" in line
                   and line.startswith("python3 -m venv"))  # fmt: skip
    extras = re.search(r'-e "\.\[([a-z,]+)\]"', command).group(1).split(",")
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    installed = project["dependencies"] + [d for e in extras for d in project["optional-dependencies"][e]]
    assert any(re.match(r"triton\b", d) for d in installed), (extras, installed)
    stages = [p for p in (root / "bench").glob("*.py") if "import triton" in p.read_text()]
    assert stages, "no bench stage imports triton: this test would guard nothing"
