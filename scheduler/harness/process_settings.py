"""The process-wide settings an Engine makes, and their undoing.

An Engine sets two things that belong to the whole process, not to it: torch's
intra-op thread count (CPU: the model gets cores - 1, docs/engine.md) and a frozen
GC generation (everything allocated at start-up is long-lived; freezing it keeps
the cyclic GC from rescanning weights and tables while probe tuples churn through
generation 0, as SGLang does). `Engine.close()` restores both, so a process that
builds engines one after another (a test, a notebook) gets its own settings back.
"""

from __future__ import annotations

import gc


class ProcessSettings:
    def __init__(self) -> None:
        self._threads: int | None = None
        self._frozen = False  # we froze a generation nobody had frozen before

    def set_threads(self, n: int) -> None:
        import torch

        if self._threads is None:
            self._threads = torch.get_num_threads()
        torch.set_num_threads(n)

    def freeze_gc(self) -> None:
        # gc.unfreeze() cannot tell whose objects it thaws: undo only a freeze that was ours alone
        self._frozen = gc.get_freeze_count() == 0
        gc.freeze()

    def restore(self) -> None:
        if self._threads is not None:
            import torch

            torch.set_num_threads(self._threads)
            self._threads = None
        if self._frozen:
            gc.unfreeze()
            self._frozen = False
