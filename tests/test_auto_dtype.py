"""`--dtype auto`: bfloat16 where this CPU's bfloat16 GEMM is measured fast, float32 elsewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from scheduler.model.auto_dtype import MIN_SPEEDUP, choose_dtype, cpu_flags, pick


def test_pick_needs_a_clear_speedup() -> None:
    assert pick(0.07) == torch.float32  # an AVX2 CPU widening bfloat16 inside the GEMM
    assert pick(MIN_SPEEDUP - 0.01) == torch.float32
    assert pick(MIN_SPEEDUP) == torch.bfloat16
    assert pick(4.0) == torch.bfloat16  # AVX512-BF16


@pytest.mark.parametrize("line,want", [
    ("flags\t\t: fpu sse avx2 fma", []),
    ("flags\t\t: fpu avx512f avx512_bf16 amx_tile amx_bf16", ["avx512_bf16", "amx_bf16"]),
    ("Features\t: fp asimd sve bf16 i8mm", ["bf16"]),
])
def test_cpu_flags(tmp_path: Path, line: str, want: list[str]) -> None:
    f = tmp_path / "cpuinfo"
    f.write_text(f"processor\t: 0\n{line}\n\nprocessor\t: 1\n{line}\n")
    assert cpu_flags(f) == want
    assert cpu_flags(tmp_path / "absent") == []


def test_asked_and_cuda_are_not_measured() -> None:
    assert choose_dtype(torch.device("cpu"), torch.float16).why == "asked"
    c = choose_dtype(torch.device("cuda"), None)  # a device object needs no GPU
    assert (c.dtype, c.why) == (torch.bfloat16, "auto: bfloat16 on CUDA")


def test_this_cpu_is_measured_and_the_choice_follows_the_measurement() -> None:
    before = torch.get_num_threads()
    c = choose_dtype(torch.device("cpu"), None)
    assert torch.get_num_threads() == before
    m = re.fullmatch(r"auto: (\w+), a \d+x\d+x\d+ bfloat16 GEMM measured ([\d.]+)x float32's speed on this CPU "
                     r"\(CPU flags: .+\)", c.why)
    assert m, c.why
    assert m.group(1) == str(c.dtype).removeprefix("torch.")
    speedup = float(m.group(2))
    if abs(speedup - MIN_SPEEDUP) > 0.01:  # the message rounds to two places
        assert pick(speedup) == c.dtype
