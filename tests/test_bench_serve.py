"""`mstrace bench-serve` as a user runs it: without its extra, and against a server of
another framing than mstrace's own."""

from __future__ import annotations

import subprocess
import sys

from tests.cli import REPO


def _without_aiohttp(*args: str) -> subprocess.CompletedProcess[str]:
    # None in sys.modules makes `import aiohttp` raise ModuleNotFoundError, as an absent package does
    code = ("import sys; sys.modules['aiohttp'] = None; "
            f"sys.argv = ['mstrace', 'bench-serve', *{list(args)!r}]; "
            "from viewer.cli import main; main()")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_without_aiohttp_bench_serve_names_the_extra_and_exits_2() -> None:
    # the port is one nothing listens on: the error must come before any request is tried
    p = _without_aiohttp("--base-url", "http://127.0.0.1:9", "--model", "tiny", "--num-prompts", "1")
    assert p.returncode == 2, p.stderr
    assert "pip install 'mstrace[bench]'" in p.stderr and "aiohttp" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    assert p.stdout == ""


def test_without_aiohttp_bench_serve_still_has_its_help() -> None:
    p = _without_aiohttp("--help")
    assert p.returncode == 0 and "--base-url" in p.stdout, p.stderr
