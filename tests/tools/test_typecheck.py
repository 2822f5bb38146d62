"""mypy over the code the CPU CI cannot run: the CUDA paths of the package, the GPU benchmarks and the GPU tests.

Why: those lines first execute on the lent GPU machine, whose time is scarce; session 31 lost a whole GPU call to a
call with a missing argument (125 failed tests) that a type checker reports in seconds. The package is installed
as an editable build whose subpackages live at the repository root (``candle_vllm/pyengine`` is ``pyengine/``), a
mapping mypy cannot follow, so the check runs over a tree of links laid out as the installed package.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def package_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``candle_vllm`` as installed, as links into the repository (pyproject's wheel package mapping)."""
    top = tmp_path_factory.mktemp("typecheck")
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["scikit-build"]["wheel"]["packages"]
    for installed, source in mapping.items():
        target = top / installed
        if installed == "candle_vllm":
            target.mkdir(parents=True)
            for f in (ROOT / source).glob("*.py"):
                (target / f.name).symlink_to(f)
        else:
            target.symlink_to(ROOT / source, target_is_directory=True)
    return top


@pytest.mark.parametrize(
    "targets,extra_paths",
    [
        (["-p", "candle_vllm"], []),
        (["benches"], []),
        (["tests/native"], ["tests/native"]),  # their shared helpers import as top-level modules
        # Two conftest.py files: module names from the tests/ base keep them apart.
        (["--explicit-package-bases", "tests/pyengine", "tests/actors"], ["tests", "tests/native"]),
    ],
    ids=["package", "benches", "native-tests", "engine-tests"],
)
def test_mypy_finds_no_errors(package_tree: Path, targets: list[str], extra_paths: list[str]) -> None:
    run = _mypy(package_tree, targets, [ROOT / p for p in extra_paths])
    assert run.returncode == 0, f"mypy {' '.join(targets)}:\n{run.stdout[-6000:]}{run.stderr[-2000:]}"


def test_the_check_sees_through_the_package_mapping(package_tree: Path, tmp_path: Path) -> None:
    """A wrong call into the package from outside it must be reported (it would pass as ``Any`` were the mapping
    not followed)."""
    probe = tmp_path / "probe.py"
    probe.write_text("from candle_vllm.pyengine.runner import ModelRunner\n\nModelRunner(1)\n")
    run = _mypy(package_tree, [str(probe)], [])
    assert run.returncode == 1 and "call-arg" in run.stdout, run.stdout


def _mypy(package_tree: Path, args: list[str], extra_paths: list[Path]) -> subprocess.CompletedProcess[str]:
    """mypy from the repository root (its pyproject config), the package tree first on its path."""
    env = {**os.environ, "MYPYPATH": os.pathsep.join(str(p) for p in (package_tree, *extra_paths))}
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(package_tree / ".mypy_cache"), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
