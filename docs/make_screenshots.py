"""The PNGs in docs/ of `mstrace top` and `mstrace view`, from a real tiny run.

    .venv/bin/python -m pip install cairosvg      # SVG -> PNG (cairo is a system library)
    .venv/bin/python docs/make_screenshots.py

`top` is captured mid-run (the run in its own process, arrivals spread over a few
seconds); `view` on the same trace once it has ended. Textual renders each screen as
SVG; cairosvg turns it into PNG.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DOCS = Path(__file__).resolve().parent
REPO = DOCS.parent
SIZE = (140, 40)


async def _shoot(app: object, svg: Path, keys: tuple[str, ...] = (), wait_s: float = 0.5) -> None:
    async with app.run_test(size=SIZE) as pilot:  # type: ignore[attr-defined]
        await pilot.pause(wait_s)
        for k in keys:
            await pilot.press(k)
        await pilot.pause()
        app.save_screenshot(str(svg))  # type: ignore[attr-defined]


def main() -> None:
    sys.path.insert(0, str(REPO))
    import cairosvg

    from viewer.tui.top_app import TopApp
    from viewer.tui.view_app import ViewApp

    tmp = Path(tempfile.mkdtemp())
    trace = tmp / "run"
    run = subprocess.Popen([sys.executable, "-m", "viewer.cli", "run", "--model", "tiny", "--requests", "1500",
                            "--rate", "150", "--snapshot-every", "16", "--out", str(trace), "-q"], cwd=REPO,
                           stdout=subprocess.DEVNULL)
    while not (trace / "meta.json").exists():
        time.sleep(0.2)
    time.sleep(6)  # into its steady state
    asyncio.run(_shoot(TopApp(trace), tmp / "top.svg", wait_s=1.0))
    run.wait()
    asyncio.run(_shoot(ViewApp(trace), tmp / "view.svg"))
    for name in ("top", "view"):
        cairosvg.svg2png(url=str(tmp / f"{name}.svg"), write_to=str(DOCS / f"{name}.png"))
        print(f"wrote {DOCS / f'{name}.png'}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
