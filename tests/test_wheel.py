"""The package as a user installs it: `python -m build` makes an sdist and a wheel from it; the
wheel goes into a fresh venv with the base dependencies only (no extra), away from the
repository, and reads the sample traces (traces/). The engine is not there, and `mstrace run`
says which extra to install in one line."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "traces"
PACKAGES = ("scheduler", "probes", "tracing", "importers", "viewer", "mstrace")  # pyproject's packages.find
pytestmark = pytest.mark.slow

# pyarrow alone is 170 MB installed (its wheel bundles Flight, S3, Substrait and Parquet), numpy
# with OpenBLAS 73 MB, the venv's own pip and setuptools 24 MB: a base venv held 282 MB of files.
# The bound is that plus headroom; the engine's torch alone would be over 1 GB.
BASE_VENV_MB = 330


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)  # type: ignore[call-overload]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    # no isolation: the suite's own setuptools, so the build needs no download; the wheel is
    # built from the unpacked sdist, which proves the sdist whole
    p = _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(REPO)])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (wheel,) = out.glob("mstrace-*.whl")
    (sdist,) = out.glob("mstrace-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist, "dir": out}


@pytest.fixture(scope="module")
def base_venv(dist: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("base") / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)]).returncode == 0
    # the suite's own versions (its venv was installed from the lock), so the base resolves
    # to what the suite runs and pip takes them from its cache
    frozen = venv.parent / "constraints.txt"
    frozen.write_text(_run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"]).stdout)
    p = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
              "-c", str(frozen), str(dist["wheel"])])
    assert p.returncode == 0, p.stderr[-3000:]
    return venv


def _in(venv: Path, exe: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`exe` of the venv, run outside the repository (its folder is not on sys.path)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return _run([str(venv / "bin" / exe), *args], cwd=venv.parent, env=env | {"COLUMNS": "120"})


def _mstrace(venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return _in(venv, "mstrace", *args)


def test_sdist_and_wheel_hold_the_package(dist: dict[str, Path]) -> None:
    names = set(zipfile.ZipFile(dist["wheel"]).namelist())
    tracked = _run(["git", "ls-files", *PACKAGES], cwd=REPO).stdout.split()
    assert len(tracked) > 100
    assert {f for f in tracked if f.endswith((".py", ".c"))} <= names
    assert not any(n.startswith(("tests/", "bench/", "traces/")) for n in names)
    sdist = tarfile.open(dist["sdist"]).getnames()
    c_sources = [f for f in tracked if f.endswith((".c", ".h"))]
    assert "viewer/analysis/_kernels.c" in c_sources
    for f in c_sources:  # a build from the sdist compiles them (a missing header: no extension, silently)
        assert any(n.endswith("/" + f) for n in sdist), f
    assert any(n.endswith("/README.md") for n in sdist)


def test_base_install_reads_the_sample_traces(base_venv: Path) -> None:
    where = _in(base_venv, "python", "-c", "import viewer; print(viewer.__file__); import torch")
    assert str(base_venv) in where.stdout, where.stdout  # the wheel's code, not the repository's
    assert "No module named 'torch'" in where.stderr
    mb = sum(f.stat().st_size for f in base_venv.rglob("*") if f.is_file() and not f.is_symlink()) / 2**20
    print(f"base venv: {mb:.0f} MB")
    assert mb <= BASE_VENV_MB

    serial, overlap, deadlock = (str(SAMPLES / f"sample-{n}") for n in ("serial", "overlap", "deadlock"))
    p = _mstrace(base_venv, "report", serial)
    assert p.returncode == 0 and "sync-cost table" in p.stdout, p.stderr
    p = _mstrace(base_venv, "diff", serial, overlap)
    assert p.returncode == 0 and "Δ (B−A)" in p.stdout, p.stderr
    p = _mstrace(base_venv, "stalls", deadlock)
    assert p.returncode == 1 and "STALLED" in p.stdout, p.stderr  # exit 1: findings
    p = _mstrace(base_venv, "leaks", serial)
    assert p.returncode == 0 and "no leaks" in p.stdout, p.stderr


def test_run_without_the_engine_names_its_extra(base_venv: Path) -> None:
    p = _mstrace(base_venv, "run", "--requests", "2", "--out", "t")
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and "install mstrace[engine]" in p.stderr, p.stderr
    assert not (base_venv.parent / "t").exists()


@pytest.mark.parametrize(("extra", "args"), [
    ("engine", ["serve"]),
    ("tui", ["view", "{serial}"]),
    ("sql", ["sql", "{serial}", "select 1"]),
    ("html", ["report", "{serial}", "--html", "r.html"]),
    ("perfetto", ["export", "{serial}", "--perfetto", "t.pftrace"]),
    ("import", ["import", "p.json", "--out", "t"]),
    ("bench", ["bench-serve"]),
])
def test_each_command_names_its_missing_extra(base_venv: Path, extra: str, args: list[str]) -> None:
    p = _mstrace(base_venv, *(a.format(serial=SAMPLES / "sample-serial") for a in args))
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and f"install mstrace[{extra}]" in p.stderr, p.stderr
    assert not any((base_venv.parent / n).exists() for n in ("r.html", "t.pftrace", "t"))


def test_the_wheel_builds_without_a_c_compiler(dist: dict[str, Path], tmp_path: Path) -> None:
    """The cost table's C kernels are optional: with no compiler the same searches run in numpy."""
    p = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
              str(dist["sdist"])], env=os.environ | {"CC": "false"})
    assert p.returncode == 0, p.stderr[-3000:]
    (wheel,) = tmp_path.glob("mstrace-*.whl")
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".so")]
