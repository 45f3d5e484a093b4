"""Run the mstrace CLI the way a user does: a separate process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def mstrace(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "viewer.cli", *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )
