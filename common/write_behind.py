"""A writer thread behind a bounded queue, for caches that must never block the caller on a slow store."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

Job = TypeVar("Job")


class WriteBehind(Generic[Job]):
    """`submit` queues a job for `write` (run on the writer thread) and never blocks: it returns False, and the job
    is dropped, when `max_items` jobs or `max_bytes` of declared job sizes are already pending. `write` should
    handle its store's errors; anything else it raises is logged and the job dropped, the writer keeps running."""

    def __init__(self, name: str, write: Callable[[Job], None], max_items: int, max_bytes: int | None = None):
        self._write = write
        self._max_bytes = max_bytes
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[Job, int] | None] = queue.Queue(max_items)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job, nbytes: int = 0) -> bool:
        with self._lock:
            if self._max_bytes is not None and self._pending_bytes + nbytes > self._max_bytes:
                return False
            self._pending_bytes += nbytes
        try:
            self._queue.put_nowait((job, nbytes))
        except queue.Full:
            with self._lock:
                self._pending_bytes -= nbytes
            return False
        return True

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            job, nbytes = item
            try:
                self._write(job)
            except Exception:  # a bug in one write must not stop the writer
                log.exception("%s: a queued write failed and was dropped", self._thread.name)
            finally:
                with self._lock:
                    self._pending_bytes -= nbytes
                self._queue.task_done()
        self._queue.task_done()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued job is written (tests, benchmarks, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def close(self) -> None:
        """Finish the queued jobs, then stop the thread."""
        if self._thread.is_alive():
            self.flush()
            self._queue.put(None)
            self._thread.join(timeout=5.0)
