"""Conv-state snapshots by id (the prefix index names them, this store holds the tensors) and the conv ops."""

from __future__ import annotations

from collections.abc import Iterable

from decode_service.engine.core.outputs import DROP, RESTORE, SNAPSHOT, ZERO, ConvOp
from decode_service.engine.worker.kv_cache import ConvSnapshot, KVCache


class SnapshotStore:
    def __init__(self, cache: KVCache):
        self.cache = cache
        self.snapshots: dict[int, ConvSnapshot] = {}

    def __len__(self) -> int:
        return len(self.snapshots)

    def put(self, snapshot_id: int, snapshot: ConvSnapshot) -> None:
        assert snapshot_id not in self.snapshots, f"snapshot {snapshot_id} stored twice"
        self.snapshots[snapshot_id] = snapshot

    def before_forward(self, ops: Iterable[ConvOp]) -> None:
        """`zero` and `restore` ops, in order (a new slot is zeroed, then given a prefix's states)."""
        for op in ops:
            if op.kind == ZERO:
                self.cache.zero_conv(op.slot)
            elif op.kind == RESTORE:
                self.cache.restore_conv(op.slot, self.snapshots[op.snapshot_id])

    def after_forward(self, ops: Iterable[ConvOp]) -> None:
        for op in ops:
            if op.kind == SNAPSHOT:
                self.put(op.snapshot_id, self.cache.snapshot_conv(op.slot))

    def drop(self, ops: Iterable[ConvOp]) -> None:
        """`drop` ops. A snapshot planned by a step that failed before taking it may be absent."""
        for op in ops:
            if op.kind == DROP:
                self.snapshots.pop(op.snapshot_id, None)
