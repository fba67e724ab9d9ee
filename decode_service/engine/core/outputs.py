"""What crosses from the control plane to the data plane: one `SchedulerOutput` per step, plain data only.

Everything here is immutable and picklable (ids, ints, bytes, tuples), so a step's plan can be sent to another
process. The per-chunk records are NamedTuples: a step of hundreds of sequences builds them in microseconds.

The data plane executes a step in this order: table updates and prefix-tier loads, the `zero`/`restore` conv
ops (in list order), the forward over `chunks` and sampling, the `snapshot` conv ops, prefix-tier saves, and
the `drop` conv ops last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

ZERO, RESTORE, SNAPSHOT, DROP = "zero", "restore", "snapshot", "drop"
BEFORE_FORWARD = frozenset((ZERO, RESTORE))


class PageUpdate(NamedTuple):
    """Block-table entries of one layer kind written since the previous output that named the sequence."""

    first: int  # table index of pages[0]
    pages: tuple[int | None, ...]  # None = a sliding page outside the window (never read)
    freed: tuple[int, ...]  # page ids the sequence released (sliding pages that left the window)


class ScheduledChunk(NamedTuple):
    """The tokens one sequence computes this step. Media rows are the data plane's copy of the request's."""

    request_id: str
    slot: int  # conv slot (and block-table row)
    start: int  # absolute position of token_ids[0]; everything before it is computed
    token_ids: tuple[int, ...]
    needs_logits: bool  # the chunk reaches the end of the known tokens: sample the next one
    sliding_pages: PageUpdate
    global_pages: PageUpdate
    new_sequence: bool  # first chunk since (re)admission: the tables start from these updates
    snapshot_id: int | None = None  # conv states after this chunk are kept under this id (a SNAPSHOT op)
    num_drafts: int = 0  # MTP verify: token_ids = (the last sampled token, *drafts); commits only accepted rows

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


class ConvOp(NamedTuple):
    """`zero` a slot, `restore` a snapshot into a slot, `snapshot` a slot after the forward, `drop` a snapshot."""

    kind: str
    slot: int | None = None
    snapshot_id: int | None = None


class PrefixLoad(NamedTuple):
    """Install a prefix the data plane found in the shared tier (`load_id` from its lookup) into new pages:
    global blocks [start_block, end_block), sliding blocks [sliding_first, end_block), conv states as a
    snapshot (restored into the slot by a `restore` op)."""

    load_id: int
    request_id: str
    start_block: int
    end_block: int
    global_pages: tuple[int, ...]
    sliding_first: int
    sliding_pages: tuple[int, ...]
    snapshot_id: int


class BlockSave(NamedTuple):
    index: int  # block index in the sequence
    block_hash: bytes
    page: int  # global page holding it


class BoundarySave(NamedTuple):
    """The sliding window and conv states at a tracked boundary (read from `slot` after the forward)."""

    block_hash: bytes  # hash of the block that ends at `boundary`
    boundary: int
    sliding_pages: tuple[int, ...]  # the window's blocks
    slot: int


class PrefixSave(NamedTuple):
    request_id: str
    blocks: tuple[BlockSave, ...]
    boundary: BoundarySave | None


@dataclass(frozen=True)
class PrefixTierPlan:
    """The shared prefix tier's I/O for this step (like vLLM's kv_connector_metadata)."""

    loads: tuple[PrefixLoad, ...] = ()
    saves: tuple[PrefixSave, ...] = ()


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...] = ()
    conv_ops: tuple[ConvOp, ...] = ()
    prefix_tier: PrefixTierPlan = PrefixTierPlan()
    preempted: tuple[str, ...] = ()  # request ids released this step, back in the queue
    finished: tuple[str, ...] = ()  # request ids terminated while scheduling (abort, cannot fit)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)
