"""Dynamic batching of tower inputs across concurrent requests.

Callers `await batcher.submit(rows)` with a `[n, ...]` array (image patches, audio frames). A single worker
task takes the first waiting submission, gathers more until the row budget is reached or `max_wait_s` has
passed since the batch opened, runs the tower once on the concatenation (in the given executor, off the
event loop) and hands every caller its own slice of the output. The towers treat rows independently (hMLP
per patch, dMel per frame), so each caller gets exactly the rows an unbatched call would give.

A submission larger than the budget runs as a batch of its own. A caller cancelled while waiting is dropped
before the batch runs; `close` fails everything still queued with `UnavailableError`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

from common.errors import UnavailableError

BatchObserver = Callable[[int, int, float, float], None]  # (items, rows, oldest wait s, run s)


@dataclass
class _Pending:
    inputs: np.ndarray
    future: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)


class DynamicBatcher:
    def __init__(
        self,
        run: Callable[[np.ndarray], np.ndarray],
        max_batch_rows: int,
        max_wait_s: float,
        executor: Executor | None = None,
        observer: BatchObserver | None = None,
    ) -> None:
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        self._run = run
        self.max_batch_rows = max_batch_rows
        self.max_wait_s = max_wait_s
        self._executor = executor
        self._observer = observer
        self._queue: asyncio.Queue[_Pending] | None = None
        self._worker: asyncio.Task | None = None
        self._carry: _Pending | None = None
        self._running: list[_Pending] = []
        self._closed = False

    async def submit(self, inputs: np.ndarray) -> np.ndarray:
        """Rows in, the tower's rows out (same count, same order)."""
        if self._closed:
            raise UnavailableError("tower batcher is shut down")
        if self._worker is None:
            self._queue = asyncio.Queue()
            self._worker = asyncio.create_task(self._loop(), name="tower-batcher")
        assert self._queue is not None
        pending = _Pending(inputs, asyncio.get_running_loop().create_future())
        self._queue.put_nowait(pending)
        return await pending.future

    async def _next(self, timeout: float | None) -> _Pending | None:
        assert self._queue is not None
        if self._carry is not None:
            pending, self._carry = self._carry, None
            return pending
        if timeout is None:
            return await self._queue.get()
        if timeout <= 0:
            return self._queue.get_nowait() if not self._queue.empty() else None
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except asyncio.TimeoutError:
            return None

    async def _gather(self) -> list[_Pending]:
        batch: list[_Pending] = []
        rows = 0
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        while rows < self.max_batch_rows:
            pending = await self._next(None if deadline is None else deadline - loop.time())
            if pending is None:
                break
            if pending.future.cancelled():
                continue
            if batch and rows + len(pending.inputs) > self.max_batch_rows:
                self._carry = pending
                break
            batch.append(pending)
            rows += len(pending.inputs)
            if deadline is None:
                deadline = loop.time() + self.max_wait_s
        return batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [p for p in await self._gather() if not p.future.cancelled()]
            if not batch:
                continue
            inputs = batch[0].inputs if len(batch) == 1 else np.concatenate([p.inputs for p in batch])
            started = time.monotonic()
            self._running = batch
            try:
                outputs = await loop.run_in_executor(self._executor, self._run, inputs)
            except Exception as exc:  # the tower failed: every caller of this batch sees it
                self._running = []
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            self._running = []  # (kept on cancellation: `close` fails those callers)
            finished = time.monotonic()
            if self._observer is not None:
                self._observer(len(batch), len(inputs), started - min(p.enqueued for p in batch), finished - started)
            if len(outputs) != len(inputs):
                error = RuntimeError(f"tower returned {len(outputs)} rows for {len(inputs)} inputs")
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(error)
                continue
            offset = 0
            for p in batch:
                n = len(p.inputs)
                if not p.future.done():
                    p.future.set_result(outputs[offset : offset + n])
                offset += n

    async def close(self) -> None:
        self._closed = True
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
        leftovers = [*self._running, *([self._carry] if self._carry is not None else [])]
        while self._queue is not None and not self._queue.empty():
            leftovers.append(self._queue.get_nowait())
        for p in leftovers:
            if not p.future.done():
                p.future.set_exception(UnavailableError("tower batcher is shut down"))
