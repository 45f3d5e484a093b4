"""The linters as part of the suite, so CI (.ci/run) runs them on a clean clone:
ruff over the repository, mypy over every package with pyproject.toml's config
(strict on probes/, tracing/ and scheduler/core/ as written there; mypy applies a
per-module `strict = true` to every module, python/mypy#11401, so in effect all of
them are strict today). Cold, mypy takes under a minute; its cache makes a rerun quick."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.cli import REPO

PACKAGES = ["scheduler", "probes", "tracing", "importers", "viewer", "mstrace"]  # every package: `mypy scheduler probes tracing importers viewer mstrace`


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *cmd], cwd=REPO, capture_output=True, text=True, timeout=600)


def test_ruff():
    p = _run("ruff", "check", "--no-cache", ".")
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.slow
def test_mypy():
    p = _run("mypy", *PACKAGES)
    assert p.returncode == 0 and "Success: no issues found" in p.stdout, p.stdout + p.stderr


def test_shell_scripts_parse():
    for script in (*REPO.glob("*.sh"), *REPO.glob("bench/*.sh"), *REPO.glob(".ci/*")):
        p = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, f"{script.name}: {p.stderr}"
