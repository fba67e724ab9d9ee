"""The ranks of a tensor-parallel decode replica at run time (issue 14): rank 0 leads, the others follow.

Rank 0 (the server process) runs the scheduler and sampling. Before it executes a step, its `LeaderRunner`
sends each follower a `StepMessage` over the control group (gloo, `scatter_object_list`): the requests added and
removed since the last step (`WorkerRequest`s without their sampling state: followers never sample), the step's
`SchedulerOutput` and, for the step's Redis prefix loads, that follower's payloads (`sharded_tier.py`). Every
follower applies the same adds / removes to its own `ModelRunner` (its KV pools hold its local heads) and
executes the same output, so the model's collectives pair up rank by rank; only rank 0 samples.

MTP speculation (`--mtp-depth`): every rank runs the drafter's depths on its shard, and what only rank 0 decides
within a step reaches the followers over the model group (`TPGroup.from_leader`) at the point it is needed: the
tokens it emitted (a follower replays the rows a verify accepted and extends its depths over them) and, per depth,
its drafts (argmax, or sampled with the request's generator above temperature 0), which the next depth's
provisional rows take as their tokens (docs/decisions.md).

Failure: the leader's watchdog waits on the follower processes; one that exits marks the replica failed, and the
next (or the running) step raises `RankFailure`, an `UnavailableError`: the service fails every stream with
UNAVAILABLE and reports NOT_SERVING. A collective with a dead peer errors (gloo) or times out (the model group's
step timeout), it never hangs. A follower exits when its parent (rank 0) does.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from common.errors import UnavailableError
from decode_service.engine.core.outputs import SchedulerOutput
from decode_service.engine.worker.kv_cache import KVCache
from decode_service.engine.worker.prefix_store import PrefixStore
from decode_service.engine.worker.runner import ModelRunner, RunnerOutput, WorkerRequest
from decode_service.engine.worker.sharded_tier import Handover, LeaderPrefixTier

log = logging.getLogger(__name__)

ADD, REMOVE = "add", "remove"


class RankFailure(UnavailableError):
    """A rank of this tensor-parallel replica died or a collective failed: the replica cannot serve."""


@dataclass(frozen=True)
class StepMessage:
    """What every follower needs for one step; `output` None ends the followers."""

    ops: tuple[tuple[str, Any], ...]  # (ADD, WorkerRequest) / (REMOVE, request id), in the leader's order
    output: SchedulerOutput | None
    loads: dict[int, Handover] = field(default_factory=dict)  # load id -> this follower's Redis prefix payloads


def follower_copy(request: WorkerRequest) -> WorkerRequest:
    """The request as a follower holds it: prompt, sampling parameters, media rows and whether it speculates (its
    depths run on every rank); no generator or structured-output matcher (those live where sampling happens, on
    rank 0)."""
    return WorkerRequest(
        request.request_id,
        list(request.prompt_token_ids),
        request.sampling,
        request.mm_items,
        list(request.output_token_ids),
        speculative=request.speculative,
    )


class RankLeader:
    """Rank 0's view of the followers: their processes (watched) and the control group the steps go over."""

    def __init__(self, size: int, control: dist.ProcessGroup, processes: list[Any]):
        self.size = size
        self.control = control
        self.processes = processes  # multiprocessing.Process of ranks 1..size-1
        self.failure: str | None = None
        self._closed = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, start=1)}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._closed.is_set():
            return
        rank = sentinels[ready[0]]
        process = self.processes[rank - 1]
        process.join(1.0)
        self.failure = f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
        log.error("%s: the replica cannot serve", self.failure)

    def wait_for_followers(self) -> None:
        """The start-up barrier (each follower enters it once its engine is built), raising `RankFailure` as soon
        as a follower dies instead of waiting out the start-up timeout."""
        work = dist.barrier(group=self.control, async_op=True)
        while not work.is_completed():
            self.check()
            time.sleep(0.05)
        work.wait()
        self.check()

    def check(self) -> None:
        if self.failure is not None:
            raise RankFailure(self.failure)

    def send(self, messages: list[StepMessage]) -> None:
        """messages[r] to rank r (messages[0] is rank 0's own, unused)."""
        self.check()
        try:
            dist.scatter_object_list([None], messages, src=0, group=self.control)
        except Exception as exc:  # a peer is gone (gloo: connection closed) or the collective timed out
            raise self.failed(f"tensor-parallel step broadcast failed: {type(exc).__name__}: {exc}") from exc

    def prefix_tier(self, cache: KVCache, fingerprint: bytes, store: PrefixStore) -> LeaderPrefixTier:
        """Rank 0's shared Redis prefix tier, whose lookups cover every rank's shard."""
        return LeaderPrefixTier(cache, fingerprint, store, self.size)

    def failed(self, what: str) -> RankFailure:
        """The failure to report after a collective raised `what`: the dead rank when the watchdog finds one
        within a moment (a peer's crash usually reaches the collective first)."""
        self._watchdog.join(2.0)
        self.failure = self.failure or what
        return RankFailure(self.failure)

    def lead(self, runner: ModelRunner) -> LeaderRunner:
        return LeaderRunner(runner, self)

    def close(self, timeout_s: float = 10.0) -> None:
        """End the followers: a last message when they are alive, then join (terminate what does not exit)."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self.failure is None:
            try:
                dist.scatter_object_list([None], [StepMessage((), None)] * self.size, src=0, group=self.control)
            except Exception:  # a follower died meanwhile: it is terminated below
                log.warning("tensor-parallel followers did not take the shutdown message")
        for process in self.processes:
            process.join(timeout_s)
            if process.is_alive():
                process.kill()
                process.join(timeout_s)
        dist.destroy_process_group()  # this process may start another replica later (tests, `generate --local`)


class LeaderRunner:
    """Rank 0's runner: the engine's `ModelRunner`, with every step sent to the followers first."""

    def __init__(self, runner: ModelRunner, leader: RankLeader):
        self.runner = runner
        self.leader = leader
        self._ops: list[tuple[str, Any]] = []

    @property
    def model(self):
        return self.runner.model

    @property
    def cache(self):
        return self.runner.cache

    def add_request(self, request: WorkerRequest) -> None:
        self.runner.add_request(request)
        self._ops.append((ADD, follower_copy(request)))

    def remove_request(self, request_id: str) -> None:
        self.runner.remove_request(request_id)
        self._ops.append((REMOVE, request_id))

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        ops, self._ops = tuple(self._ops), []
        tier = self.runner.prefix_tier
        handovers = {load.load_id: tier.take_handover(load.load_id) for load in output.prefix_tier.loads}
        self.leader.send(
            [
                StepMessage(ops, output, {load_id: parts[r - 1] for load_id, parts in handovers.items()} if r else {})
                for r in range(self.leader.size)
            ]
        )
        try:
            return self.runner.execute(output)
        except Exception as exc:  # the ranks' collectives may now be out of step: the replica cannot go on
            raise self.leader.failed(f"tensor-parallel step failed: {type(exc).__name__}: {exc}") from exc


def follow(runner: ModelRunner, control: dist.ProcessGroup) -> None:
    """A follower's loop: apply each step the leader broadcasts until it sends the end."""
    while True:
        box: list[StepMessage | None] = [None]
        dist.scatter_object_list(box, None, src=0, group=control)
        message = box[0]
        assert message is not None
        for op, arg in message.ops:
            if op == ADD:
                runner.add_request(arg)
            else:
                runner.remove_request(arg)
        if message.output is None:
            return
        for load_id, handover in message.loads.items():
            runner.prefix_tier.receive(load_id, handover)
        runner.execute(message.output)
