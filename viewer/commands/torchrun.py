"""The torchrun entry point (`torchrun ... -m viewer.commands.torchrun run --tp N --pp M ...`):
rank 0 is the scheduler, running the mstrace command line it was given; every other
rank is a model worker (scheduler/parallel/worker.py)."""

from __future__ import annotations

import os
import sys


def main() -> int:
    if int(os.environ.get("RANK", "0")) == 0:
        from viewer.cli import main as cli_main

        sys.argv = ["mstrace", *sys.argv[1:]]
        cli_main()
        return 0
    from scheduler.parallel.worker import worker_main

    return worker_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
