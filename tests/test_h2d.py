"""The model step queues its host -> device copies; it never waits for the device.

On a GPU `torch.tensor(values, device=cuda)` copies from pageable memory and torch then
synchronises the stream, so one such call inside the forward makes the launching thread
wait for every kernel before it (the first GPU run, BENCHMARKS.md "The first run on a GPU":
the barrier waited 0.00 ms because the launch had already waited). This CPU machine cannot
see that; the source can: every copy in the step goes through scheduler/model/h2d.py."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from scheduler.model.h2d import host_to_device, to_device

STEP = [Path("scheduler/model") / f for f in ("sampling.py", "penalties.py", "forward_batch.py", "forward_step.py",
                                              "transformer.py", "layers.py")]


def _calls_with_device(tree: ast.AST) -> list[int]:
    """Lines of torch.tensor(...)/torch.as_tensor(...) calls given device=, whatever it is."""
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("tensor", "as_tensor") and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch" and any(k.arg == "device" for k in node.keywords)):
            lines.append(node.lineno)
    return lines


def test_no_host_list_reaches_the_device_through_a_pageable_copy():
    root = Path(__file__).resolve().parent.parent
    found = {}
    for f in STEP:
        tree = ast.parse((root / f).read_text())
        if lines := _calls_with_device(tree):
            found[str(f)] = lines
    assert not found, f"torch.tensor/as_tensor(..., device=) in the model step: {found}; use scheduler/model/h2d.py"


def test_the_copies_keep_values_and_dtypes():
    cpu = torch.device("cpu")
    t = to_device([3, -1, 7], torch.long, cpu)
    assert t.dtype == torch.long and t.tolist() == [3, -1, 7]
    assert to_device([0.5, 2.0], torch.bfloat16, cpu).dtype == torch.bfloat16
    assert to_device([True, False], torch.bool, cpu).tolist() == [True, False]
    host = torch.arange(4)
    assert host_to_device(host, cpu) is host  # the CPU's device tensor is the host tensor
