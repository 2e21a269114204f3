"""One background thread that writes checkpoints, one write at a time.

The training thread hands over a write (a snapshot already in host memory)
and goes on training. A new write first waits for the one in flight, so at
most one snapshot is ever held and none is skipped. A write's error is kept
and raised in the training thread the next time it looks: at the next batch
end, the next save, or train end. The thread is not a daemon, so the
interpreter waits for a pending commit before it exits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class PendingWrite:
    """A write handed to the background thread."""

    def __init__(self, write: Callable[[], Any]):
        self._write = write
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name="keras-ft-checkpoint-writer", daemon=False
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._write()
        except BaseException as e:  # Handed to the training thread.
            self._error = e

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> Any:
        """Waits for the write; returns its result or raises its error."""
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._result


class BackgroundWriter:
    """Runs writes in the background, at most one at a time."""

    def __init__(self) -> None:
        self._pending: PendingWrite | None = None

    def submit(self, write: Callable[[], Any]) -> None:
        """Waits for the write in flight (raising its error), starts `write`."""
        self.wait()
        self._pending = PendingWrite(write)

    def wait(self) -> Any:
        """Waits for the write in flight; returns its result or raises its error."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    @property
    def busy(self) -> bool:
        """Whether a write is still running."""
        return self._pending is not None and not self._pending.done

    def raise_if_failed(self) -> None:
        """Raises the error of a write that has finished, without waiting."""
        if self._pending is not None and self._pending.done:
            self.wait()
