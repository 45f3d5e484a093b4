"""The dtypes the engine runs in, by the names the CLI, config.json and the wire use."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ALIASES = {"float": "float32", "half": "float16"}  # config.json's torch_dtype spellings


def dtype_of(name: str) -> torch.dtype | None:
    """"bfloat16", "torch.float16", "half" -> the torch dtype; None if it is none of ours."""
    n = str(name).removeprefix("torch.")
    return DTYPES.get(_ALIASES.get(n, n))


def name_of(dtype: torch.dtype) -> str:
    return next(n for n, d in DTYPES.items() if d == dtype)
