"""The one background thread that drives the decode service's `Engine` (which is not thread-safe).

Requests and aborts enter through a queue of commands; each request's outputs go back to its `Sink`, an asyncio
queue of the event loop's thread, with `loop.call_soon_threadsafe`. After every step the thread refreshes the load
and speculation snapshots that health and metrics read. An engine step that raises fails the live requests; a lost
tensor-parallel rank fails them and every later one (`failure`), then calls `on_lost`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from common.errors import UnavailableError
from decode_service.api import EngineFailure, LoadSnapshot
from decode_service.engine.engine import Engine, RequestOutput, SpeculationSnapshot
from decode_service.engine.request import Request, RequestStatus
from decode_service.engine.worker.ranks import RankFailure

log = logging.getLogger(__name__)


class Sink:
    """Where the engine thread delivers one request's outputs (an asyncio queue of another thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.submitted_at = time.monotonic()
        self.scheduled_at: float | None = None  # written by the engine thread before the first delivery
        self.request: Request | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is gone; nobody is listening any more
            pass


@dataclass(frozen=True)
class _Add:
    """Add `request` to the engine; its outputs go to `sink`."""

    request: Request
    sink: Sink


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Wake:
    """Nothing to do: unblocks the engine thread (shutdown)."""


_Command = _Add | _Abort | _Wake


class EngineThread:
    """`submit` and `abort` from any thread; the engine itself is touched only by the thread `start` starts."""

    def __init__(self, engine: Engine, on_lost: Callable[[], None]) -> None:
        self.engine = engine
        self.on_lost = on_lost  # called once, from the engine thread, after a rank was lost
        self.failure: RankFailure | None = None  # a tensor-parallel rank died: every stream fails UNAVAILABLE
        self.load = LoadSnapshot()  # running / waiting / KV usage after the last step
        self.speculation = SpeculationSnapshot()  # MTP acceptance since the engine started
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="decode-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to fail what is live and exit (`join` waits for it)."""
        self._stopping.set()
        self._commands.put(_Wake())

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, request: Request, sink: Sink) -> None:
        self._commands.put(_Add(request, sink))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    # -- the thread ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._drain(block=self.failure is not None or not self.engine.has_unfinished)
            ranks = self.engine.ranks
            if self.failure is None and ranks is not None and ranks.failure is not None:
                self._lost(RankFailure(ranks.failure))
            if self.failure is None and self.engine.has_unfinished:
                step_started = time.monotonic()
                try:
                    outputs = self.engine.step()
                except RankFailure as exc:
                    self._lost(exc)
                    continue
                except Exception as exc:  # a bug below the engine's own error handling: fail, never hang
                    log.exception("engine step raised; failing the %d live requests", len(self._sinks))
                    self._fail_all(EngineFailure(f"engine step failed: {type(exc).__name__}: {exc}"))
                    continue
                self._note_scheduled(step_started)
                self._update_load()  # before the outputs: a client that has its last token sees its step's stats
                for out in outputs:
                    sink = self._sinks.get(out.request_id)
                    if sink is None:
                        continue
                    if out.finished:
                        del self._sinks[out.request_id]
                    sink.put(out)
            else:
                self._update_load()
        self._fail_all(UnavailableError("decode service is shutting down"))

    def _lost(self, failure: RankFailure) -> None:
        """The replica cannot serve any more: every stream (and every later one) fails UNAVAILABLE."""
        log.error(
            "decode replica lost a tensor-parallel rank (%s); failing %d live requests", failure, len(self._sinks)
        )
        self.failure = failure
        self._fail_all(failure)
        self.on_lost()

    def _fail_all(self, error: BaseException) -> None:
        for rid, sink in list(self._sinks.items()):
            self.engine.abort(rid)
            sink.put(error)
        self._sinks.clear()

    def _drain(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: _Command) -> None:
        if isinstance(command, _Add):
            if self.failure is not None:
                command.sink.put(self.failure)
                return
            try:
                self.engine.add_request(command.request)
            except Exception as exc:  # validation errors go back to the caller, the engine carries on
                command.sink.put(exc)
                return
            command.sink.request = command.request
            self._sinks[command.request.request_id] = command.sink
        elif isinstance(command, _Abort):
            self.engine.abort(command.request_id)

    def _note_scheduled(self, step_started: float) -> None:
        """Requests that left WAITING in the step that began at `step_started` were scheduled then."""
        for sink in self._sinks.values():
            if (
                sink.scheduled_at is None
                and sink.request is not None
                and sink.request.status is not RequestStatus.WAITING
            ):
                sink.scheduled_at = step_started

    def _update_load(self) -> None:
        cache = self.engine.cache
        total = sum(pool.num_pages for pool in cache.pools.values())
        free = sum(pool.num_free for pool in cache.pools.values())
        scheduler = self.engine.scheduler
        self.load = LoadSnapshot(
            len(scheduler.running), len(scheduler.waiting), 1.0 - free / total if total else 0.0, free
        )
        self.speculation = self.engine.speculation.snapshot(self.engine.speculation_depth)
