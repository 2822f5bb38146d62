"""benches/gpu_ab.sh's A/B flow in a scratch git repository, its build replaced by a no-op (GPU_AB_BUILD): the
commands see the changed tree, then the tree with the patch reversed, the tree ends as it began, and everything comes
back in one archive."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benches" / "gpu_ab.sh"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A git repository holding gpu_ab.sh and weights.txt ("old" committed, "new" in the working tree)."""
    if shutil.which("git") is None:
        pytest.skip("no git")
    root = tmp_path / "repo"
    (root / "benches").mkdir(parents=True)
    shutil.copy(SCRIPT, root / "benches" / "gpu_ab.sh")
    (root / "weights.txt").write_text("old\n")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["git", "init", "-q"], ["git", "add", "."], ["git", "commit", "-qm", "base"]):
        subprocess.run(cmd, cwd=root, check=True, env=env)
    (root / "weights.txt").write_text("new\n")
    (root / "change.patch").write_text(subprocess.run(["git", "diff"], cwd=root, check=True, capture_output=True,
                                                      text=True).stdout)
    return root


def _run(repo: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUT": str(out), "GPU_AB_BUILD": "echo building"}
    return subprocess.run(["bash", "benches/gpu_ab.sh", *args], cwd=repo, env=env, capture_output=True, text=True)


def _unpack(out: Path) -> Path:
    with tarfile.open(out / "ab.tgz") as tar:
        tar.extractall(out / "unpacked", filter="data")
    return out / "unpacked" / "ab"


def test_each_command_runs_on_the_change_then_on_the_base(repo: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = _run(repo, out, "change.patch", "cat weights.txt > {out}/w.txt", "exit 3")
    assert done.returncode == 0, done.stderr
    ab = _unpack(out)
    assert (ab / "b" / "w.txt").read_text() == "new\n" and (ab / "a" / "w.txt").read_text() == "old\n"
    assert not (ab / "b2").exists()
    assert (ab / "build_b.log").read_text() == "building\n" and (ab / "a" / "2.log").exists()
    assert "b command 2: exit 3" in done.stdout and "a command 1: exit 0" in done.stdout
    assert (repo / "weights.txt").read_text() == "new\n"  # the patch is back on
    assert not (out / "ab").exists()  # only the archive is left for the device tool to bring back


def test_aba_runs_the_change_again(repo: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert _run(repo, out, "--aba", "change.patch", "cat weights.txt > {out}/w.txt").returncode == 0
    assert (_unpack(out) / "b2" / "w.txt").read_text() == "new\n"


def test_a_patch_that_does_not_reverse_stops_before_the_base_runs(repo: Path, tmp_path: Path) -> None:
    (repo / "weights.txt").write_text("other\n")
    out = tmp_path / "out"
    done = _run(repo, out, "change.patch", "cat weights.txt > {out}/w.txt")
    assert done.returncode == 1 and "does not reverse" in done.stdout
    ab = _unpack(out)
    assert (ab / "b" / "w.txt").read_text() == "other\n" and not (ab / "a").exists()
