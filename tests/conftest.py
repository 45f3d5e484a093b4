"""What several test modules share, made once per session: the tiny traces they read
(tests/support/tiny_runs.py, one per set of flags, shared by the xdist workers), a llama
checkpoint and a running `mstrace serve`. The helpers themselves are in tests/support/."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.exact import F32_ARGS
from tests.support.serve_proc import Served, serving
from tests.support.tiny_runs import TinyRuns, session_root


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: a worker more than the cores. Most of a test's time is a command it waits
    for (a run, a server, a device process), so one worker per core left a core idle
    about a sixth of the suite; the tests must pass on a loaded machine anyway."""
    return (os.cpu_count() or 1) + 1


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules with slow tests first, in their own order: `--dist loadscope` hands out
    whole modules in collection order, and a long one handed out last is the suite's tail.
    pyproject's `--no-loadscope-reorder` keeps that order: by default xdist re-sorts the
    modules by their number of tests, which handed test_kill.py's two tests (two and a half
    minutes) out near the end (ci41)."""
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow)  # stable: modules stay whole


@pytest.fixture(scope="session")
def tiny_runs(tmp_path_factory: pytest.TempPathFactory) -> TinyRuns:
    return TinyRuns(session_root(tmp_path_factory))


@pytest.fixture(scope="session")
def tiny_trace(tiny_runs: TinyRuns) -> Path:
    """A serial run with memory snapshots: what the analyses of one clean trace read."""
    run = tiny_runs("--requests", "32", "-q", "--snapshot-every", "5")
    assert "sync-cost table" in run.stdout  # run prints the report
    return run.out


@pytest.fixture(scope="session")
def overlap_trace(tiny_runs: TinyRuns) -> Path:
    """An overlap run (split streams: kv fences)."""
    return tiny_runs("--requests", "24", "--mode", "overlap", "-q").out


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """build_llama's checkpoint (tests/support/checkpoints.py), read-only: a test that
    changes a checkpoint changes a copy."""
    from tests.support.checkpoints import build_llama  # transformers: only where it is asked for

    return build_llama(tmp_path_factory.mktemp("ckpt") / "llama")


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`mstrace serve --model tiny` with the default flags but float32 and one GEMM (its
    logprobs are compared with transformers in float32, its tokens with `mstrace run`'s;
    auto may pick bfloat16 on a GPU or an AMX CPU), for the worker's whole session; it must
    stop cleanly (exit 0) at the end. A test that stops or breaks its server starts its own."""
    with serving(tmp_path_factory.mktemp("serve") / "trace", *F32_ARGS) as s:
        yield s


@pytest.fixture(scope="session")
def client(server: Served) -> Any:
    """The official openai client on the session's server."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0)
