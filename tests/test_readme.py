"""The README and docs/ stay honest: their Python examples run, their excerpts are in the scripts
they name, and CI runs the README's test command verbatim."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tritonscale.torch_compat import COMPILED_CLIP, has_torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))


def code_blocks(language: str, text: str = README) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


#: A block starting with this line is an excerpt of a script that needs several processes: it is
#: not run here but must appear, line for line, in that script (which tests/test_examples.py runs).
EXCERPT = "# examples/"
#: docs/ may also show excerpts of the tests (the GPU tier's, which cannot run here).
EXCERPTS = (EXCERPT, "# tests/")


def test_python_examples_run():
    blocks = [block for block in code_blocks("python") if not block.startswith(EXCERPT)]
    assert blocks, "the README must show the training-loop example"
    namespaces = []
    for block in blocks:
        namespaces.append({})
        exec(compile(block, "README.md", "exec"), namespaces[-1])
    # The example's loop really ran a scaled, clipped step. (It is seeded: unseeded, about 3% of
    # draws overflow float16 at scale 2**16, the step is skipped and the scale backs off.)
    loop = next(n for n in namespaces if "grad_norm" in n)
    assert loop["grad_norm"].dtype == torch.float32
    assert loop["scaler"].get_scale() == 2.0**16


def test_the_per_layer_logging_recipe_runs_for_a_plain_optimizer_too():
    """The README's recipe for reading gradients between the clip and the step divided by
    ``folded_grad_scale``, which is None with a non-fused optimizer (a TypeError in the old recipe):
    a block shows it with a fused and a plain optimizer, and runs (test_python_examples_run)."""
    recipes = [block for block in code_blocks("python") if "folded_grad_scale" in block]
    assert recipes and all("fused=False" in block or "for fused in" in block for block in recipes), recipes
    for block in recipes:
        exec(compile(block, "README.md", "exec"), {})


@pytest.mark.parametrize("page", DOCS, ids=[page.name for page in DOCS])
def test_docs_python_examples_run(page):
    refused = 0  # blocks that compile the clip: refused before torch 2.12 (tests/test_torch_compat.py)
    for block in code_blocks("python", page.read_text()):
        if not has_torch(COMPILED_CLIP) and "torch.compile" in block and "clip_grad_norm_" in block:
            refused += 1
        elif not block.startswith(EXCERPTS):
            exec(compile(block, str(page.relative_to(ROOT)), "exec"), {})
    if refused:
        pytest.skip(f"the other blocks ran; {refused} compile clip_grad_norm_, which needs torch>=2.12")


def test_excerpts_are_in_their_scripts():
    pages = [README, *(page.read_text() for page in DOCS)]
    excerpts = [block for text in pages for block in code_blocks("python", text) if block.startswith(EXCERPTS)]
    multi_process = code_blocks("python", (ROOT / "docs" / "multi-process.md").read_text())
    assert any(block.startswith(EXCERPT) for block in multi_process), (
        "docs/multi-process.md shows the example's layouts"
    )
    for block in excerpts:
        source, *lines = block.splitlines()
        script = (ROOT / source.removeprefix("# ").strip()).read_text()
        excerpt = "\n".join(lines).strip("\n")
        assert excerpt in script, f"excerpt not in {source}:\n{excerpt}"


def test_ci_runs_the_readme_test_command():
    commands = [line.strip() for block in code_blocks("bash") for line in block.splitlines() if line.strip()]
    assert len(commands) == 2, "exactly two set-up-included commands: main job and tests"
    main_job, tests = commands
    assert "bench/run_all.py" in main_job and tests.endswith("pytest")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in [line.strip() for line in ci]


def test_relative_links_resolve():
    """Every relative link of the README and docs/ names a file that exists."""
    for page in [ROOT / "README.md", *DOCS, ROOT / "CHANGELOG.md"]:
        prose = re.sub(r"`[^`\n]*`", "", page.read_text())  # a code span holds no link: `kernel[grid](*args)`
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", prose):
            if not target.startswith(("http://", "https://")):
                assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to missing {target}"


#: A results file cited in prose: a relative link or a backquoted path under bench/results/.
#: ``{a,b}`` as the shell expands it (``issue30-{old,new}{1,2,3}.json``: six files).
RESULTS_CITATION = re.compile(r"(?:\]\(|`)((?:\.\./)?bench/results/[\w./{},-]+)")


def expand_braces(pattern: str) -> list[str]:
    found = re.search(r"\{([^{}]*)\}", pattern)
    if not found:
        return [pattern]
    head, tail = pattern[: found.start()], pattern[found.end() :]
    return [name for option in found.group(1).split(",") for name in expand_braces(head + option + tail)]


def cited_results(page: Path) -> list[tuple[str, Path]]:
    """Each results file or folder the page cites, resolved from the page's folder (links) or the root."""
    cited = []
    for found in RESULTS_CITATION.findall(page.read_text()):
        for name in expand_braces(found):
            path = (page.parent / name) if name.startswith("../") else ROOT / name
            cited.append((name, path.resolve()))
    return cited


@pytest.mark.parametrize("page", [ROOT / "README.md", *DOCS], ids=["README.md", *(page.name for page in DOCS)])
def test_every_cited_results_file_exists(page):
    missing = [found for found, path in cited_results(page) if not path.exists()]
    assert not missing, f"{page.name} cites results files that do not exist: {missing}"


def test_the_results_citations_are_found():
    # The check above is not vacuous: the README and the performance page cite the H100 run.
    readme = [found for found, _ in cited_results(ROOT / "README.md")]
    assert "bench/results/h100/gpu_tier.log" in readme, readme
    assert any("h100" in found for found, _ in cited_results(ROOT / "docs" / "performance.md"))
