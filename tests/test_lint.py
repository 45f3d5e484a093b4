"""The linters as part of the suite, so CI (.ci/run) runs them on a clean clone:
ruff over the repository, mypy on the typed core (strict on probes/, tracing/ and
scheduler/core/, as pyproject.toml says)."""

from __future__ import annotations

import subprocess
import sys

from tests.cli import REPO

TYPED = ["probes", "tracing", "scheduler/core"]


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *cmd], cwd=REPO, capture_output=True, text=True, timeout=600)


def test_ruff():
    p = _run("ruff", "check", "--no-cache", ".")
    assert p.returncode == 0, p.stdout + p.stderr


def test_mypy():
    p = _run("mypy", *TYPED)
    assert p.returncode == 0, p.stdout + p.stderr


def test_shell_scripts_parse():
    for script in (*REPO.glob("*.sh"), *REPO.glob("bench/*.sh"), *REPO.glob(".ci/*")):
        p = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, f"{script.name}: {p.stderr}"
