"""The demos' live progress: a table in a terminal, a plain line every 5 seconds elsewhere."""

from __future__ import annotations

import asyncio
from typing import Any


async def show_progress(render: Any, line: Any, state: Any, console: Any, live: bool) -> None:
    """Until ``state.stopping``: a live table (``render()``) in a terminal, else (CI, a pipe) the
    plain ``line()`` every 5 seconds. Shared by the demos."""
    if live:
        from rich.live import Live

        with Live(console=console, auto_refresh=False, transient=False) as view:
            while not state.stopping:
                view.update(render(), refresh=True)
                await asyncio.sleep(0.25)
            view.update(render(), refresh=True)
        return
    next_line = 5.0
    while not state.stopping:
        if state.elapsed() >= next_line:
            next_line += 5.0
            console.print(f"[{state.elapsed():5.1f}s] {line()}", highlight=False)
        await asyncio.sleep(0.25)
