"""What this project's commands show a person: their own progress lines, stamped with the
seconds since the command started, and while a long step runs a spinner or a bar.

The spinner and the bar are drawn only when the output is a terminal, and vanish when their
step ends; what stays on the screen is the lines, the same lines a log or a pipe receives.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, TextIO, TypeVar

if TYPE_CHECKING:
    from rich.progress import Progress

__all__ = ["Console"]

T = TypeVar("T")


class Console:
    """Progress lines, and live progress on a terminal.

    Args:
        stream: where lines go (default: standard output).
        live: draw spinners and bars; default: when ``stream`` is a terminal.
    """

    def __init__(self, stream: TextIO | None = None, *, live: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.started = time.perf_counter()
        self._progress: Progress | None = None
        self._tasks = 0

    @property
    def elapsed(self) -> float:
        """Seconds since the console was made (the command started)."""
        return time.perf_counter() - self.started

    def line(self, message: str) -> None:
        """Print ``[  12.3s] message``, above any spinner or bar."""
        text = f"[{self.elapsed:6.1f}s] {message}"
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, file=self.stream, flush=True)

    def print(self, text: str = "") -> None:
        """Print ``text`` as it is (a table, a closing note), above any spinner or bar."""
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, file=self.stream, flush=True)

    @contextlib.contextmanager
    def step(self, message: str) -> Iterator[None]:
        """Print ``message`` as a line; on a terminal, a spinner with the step's elapsed time
        until the block ends."""
        self.line(message)
        with self._task(message, None):
            yield

    @contextlib.contextmanager
    def bar(self, message: str, total: int) -> Iterator[Callable[[], None]]:
        """A bar of ``total`` steps on a terminal while the block runs; the block calls what it
        is given once per step done. Prints nothing by itself."""
        with self._task(message, total) as advance:
            yield advance

    def track(self, items: Iterable[T], message: str, total: int | None = None) -> Iterator[T]:
        """``items``, one at a time, with a bar over them on a terminal."""
        items = list(items) if total is None else items
        count = total if total is not None else len(items)  # type: ignore[arg-type]
        with self.bar(message, count) as advance:
            for item in items:
                yield item
                advance()

    @contextlib.contextmanager
    def _task(self, message: str, total: int | None) -> Iterator[Callable[[], None]]:
        if not self.live:
            yield lambda: None
            return
        progress = self._start()
        task = progress.add_task(message, total=total)
        self._tasks += 1
        try:
            yield lambda: progress.advance(task)
        finally:
            progress.remove_task(task)
            self._tasks -= 1
            if self._tasks == 0:
                self._progress = None
                progress.stop()

    def _start(self) -> Progress:
        if self._progress is not None:
            return self._progress
        from rich.console import Console as RichConsole
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(bar_width=30),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=RichConsole(file=self.stream),
            transient=True,
        )
        self._progress.start()
        return self._progress
