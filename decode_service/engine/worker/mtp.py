"""Data plane of MTP speculation: the drafter's per-request state and the draft chain (spec inkling-text 7.2-7.5).

Rows. Depth d is a causal sequence model over the trunk's rows: row i pairs the previous hidden `g_{d-1}(i)`
(`g_{-1}` = the trunk's final-normed hidden `y`) with the token at position `i + d + 1`. With `K` known tokens
(prompt + accepted output) and the trunk's rows computed through `L` (`L + 1 <= K - 1`), row i of depth d is
*committed* when its token is known (`i + d + 1 < K`) and *provisional* when it is one of this round's drafts
(`d_1` is depth 0's guess for position K, ...). A round (`extend`) runs, per depth, the rows from its committed
count through L: the committed ones first, then a snapshot of the depth's KV and conv states, then the
provisional ones (only when drafting), whose argmax at row L is the next draft. The next round restores that
snapshot before it continues, so a depth's caches only ever hold rows it could compute from known tokens, plus
this round's provisional tail. Committed rows of depth d - 1 that depth d has not committed yet wait in
`pending[d]` (their hidden). Every depth therefore sees exactly the rows the training-consistent view feeds it
(HF's MtpModel / SG's draft-extend), whatever the acceptance.

Multimodal prompts: a depth's token at a media placeholder row is the placeholder id (its embedding); the media
rows reach the depths through the trunk's hidden at those rows (decisions.md).

`DraftModel` is what the runner calls: `MTPSpeculator` (the checkpoint's drafter) or a test double.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, overload

import numpy as np
import torch

from decode_service.engine.worker.draft_graphs import AHEAD_PAGES, DepthPools, DepthSequence, DraftGraphs, RoundRows
from decode_service.engine.worker.kv_cache import CacheSpec
from decode_service.engine.worker.sampler import to_device
from decode_service.model.batch import ForwardBatch, SequenceSlice
from decode_service.model.mtp import MTPDrafter
from decode_service.model.state import ContiguousLayerCache, SequenceState

logger = logging.getLogger(__name__)

_MAX_LAG = 64  # rows a depth past the round's drafts may queue before it catches up (PagedMTPSpeculator)


class Tokens(Sequence[int]):
    """A request's known tokens, `head + tail` (its prompt and its output) read in place: a round reads a few of
    the last tokens, so the runner hands its two lists over without concatenating the whole history. A view of the
    lists as they are when it is made (they must not shrink while it is read)."""

    __slots__ = ("head", "tail", "_split", "_len")

    def __init__(self, head: list[int], tail: list[int]):
        self.head, self.tail = head, tail
        self._split = len(head)
        self._len = self._split + len(tail)

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        n, k = self._split, self._len
        if not isinstance(index, slice):
            if not -k <= index < k:
                raise IndexError(f"token {index} of {k}")
            index = index + k if index < 0 else index
            return self.head[index] if index < n else self.tail[index - n]
        start, stop, step = index.indices(k)
        if step != 1:
            return [self[i] for i in range(start, stop, step)]
        stop = max(start, stop)
        if start >= n:
            return self.tail[start - n : stop - n]
        if stop <= n:
            return self.head[start:stop]
        return self.head[start:] + self.tail[: stop - n]


class DraftInput(NamedTuple):
    """One request's trunk rows of this step, as the drafter consumes them (a tuple: built per request and round)."""

    request_id: str
    first_row: int  # absolute position of hidden[0]
    hidden: torch.Tensor  # [m, H] the trunk's final-normed rows first_row .. first_row + m - 1 (committed rows only)
    token_ids: Sequence[int]  # every known token (prompt + output, including the one sampled this step): a list
    # or `Tokens`, read, never kept
    draft: bool  # the trunk sampled a token this step: propose the next drafts
    temperature: float = 0.0  # > 0: drafts are sampled from the depth's softmax(logits / temperature), kept as `q`
    generator: torch.Generator | None = None  # draws those drafts (a seeded request's own; None: the drafter's)


class DraftModel(Protocol):
    """Proposes draft tokens for requests from the trunk rows they committed."""

    num_depths: int

    def extend(self, inputs: list[DraftInput]) -> dict[str, tuple[int, ...]]:
        """Consume the committed trunk rows of each input; drafts (`num_depths` tokens) for the inputs that draft."""
        ...

    def reset(self, request_id: str, start: int, token_ids: list[int], pages: list[int | None]) -> None:
        """A (re)admitted sequence whose trunk rows begin at `start` (0, or a prefix-cache hit's length);
        `pages`: its global block table (where the trunk rows of a cached prefix were remembered)."""
        ...

    def remember(self, hidden: torch.Tensor, rows: list[tuple[list[int | None], int, int, int]]) -> None:
        """The trunk's rows of a step: for each (global block table, start, first, n), `hidden[first : first + n]`
        are the rows of positions `start ..` of the sequence with that block table."""
        ...

    def forget(self, pages: tuple[int, ...]) -> None:
        """Global pages whose KV came from elsewhere (the shared tier): no trunk rows for them."""
        ...

    def remove(self, request_id: str) -> None: ...

    def draft_probs(self, request_id: str) -> torch.Tensor | None:
        """`[D, V]` the distributions the last drafts of `request_id` were sampled from (rejection sampling);
        None: they were chosen deterministically (the verifier then samples the target row by row)."""
        ...


def _leader_picks(drafter: MTPDrafter, picks: list[int]) -> list[int]:
    """Tensor parallel: every rank runs the depths on its shard, rank 0's drafts are the drafts of all of them
    (sampled drafts use the leader's generators; the followers' provisional rows must see the same tokens)."""
    if drafter.tp.size == 1:
        return picks
    ids = torch.tensor(picks, dtype=torch.int64, device=drafter.embed.weight.device)
    return drafter.tp.from_leader(ids).tolist()


def _save(layer: ContiguousLayerCache) -> tuple:
    return layer.k, layer.v, layer.first_position, [c.clone() for c in layer.conv]


def _restore(layer: ContiguousLayerCache, saved: tuple) -> None:
    layer.k, layer.v, layer.first_position, conv = saved
    layer.conv = [c.clone() for c in conv]


@dataclass
class _DrafterState:
    """One request's drafter caches (`state.layers[d]` = depth d) and row bookkeeping."""

    state: SequenceState
    committed: list[int]  # rows of each depth whose KV/conv are committed: 0 .. committed[d] - 1
    pending: list[torch.Tensor | None]  # pending[d] (d >= 1): g_{d-1} rows committed[d] .. committed[d-1] - 1
    saved: list[tuple | None]  # each depth's caches at committed[d] (restored before its next rows)


class MTPSpeculator:
    """The checkpoint's drafter over the engine's requests (caches: one contiguous `SequenceState` per request, each
    depth in its own geometry with its 4 conv states; outside the paged KV budget)."""

    def __init__(self, drafter: MTPDrafter, num_depths: int):
        if not 1 <= num_depths <= drafter.num_depths:
            raise ValueError(f"mtp_depth: expected 1..{drafter.num_depths} (the checkpoint's depths), got {num_depths}")
        self.drafter = drafter
        self.num_depths = num_depths
        self.depth_for: Callable[[int], int] = lambda batch: num_depths  # drafts per round of `batch` drafting
        self.states: dict[str, _DrafterState] = {}
        self.probs: dict[str, list[torch.Tensor]] = {}  # the sampled drafts' distributions, per request
        self.rows: torch.Tensor | None = None  # see enable_prefix_rows
        self.valid: torch.Tensor | None = None
        self.page_size = 0

    def draft_probs(self, request_id: str) -> torch.Tensor | None:
        probs = self.probs.get(request_id)
        return torch.stack(probs) if probs else None

    def enable_prefix_rows(self, num_pages: int, page_size: int) -> None:
        """Keep the trunk's final-normed row of every position in a pool laid out like the global KV pages, so a
        prefix-cache hit recomputes the depths over the cached prefix (its pages hold those rows as long as they
        hold its KV). Outside the KV budget: H values per cached position."""
        weight = self.drafter.embed.weight
        rows = (num_pages + 1) * page_size
        self.page_size = page_size
        self.rows = torch.zeros(rows, self.drafter.config.hidden_size, dtype=weight.dtype, device=weight.device)
        self.valid = torch.zeros(rows, dtype=torch.bool, device=weight.device)

    def _flat(self, pages: list[int | None], start: int, n: int) -> torch.Tensor | None:
        positions = torch.arange(start, start + n)
        ids = [pages[p] for p in range(start // self.page_size, (start + n - 1) // self.page_size + 1)]
        if None in ids:
            return None
        table = torch.tensor(ids, dtype=torch.int64)
        flat = table[positions // self.page_size - start // self.page_size] * self.page_size
        return (flat + positions % self.page_size).to(self.rows.device)

    def remember(self, hidden: torch.Tensor, rows: list[tuple[list[int | None], int, int, int]]) -> None:
        """One write for the step's rows (one index upload, one gather and one scatter, whatever the batch)."""
        if self.rows is None:
            return
        page, source, target = self.page_size, [], []
        for pages, start, first, n in rows:
            source.extend(range(first, first + n))
            target.extend(pages[p // page] * page + p % page for p in range(start, start + n))
        if not source:
            return
        index = to_device(source + target, self.rows.device)
        flat = index[len(source) :]
        self.rows.index_copy_(0, flat, hidden.index_select(0, index[: len(source)]).to(self.rows.dtype))
        self.valid[flat] = True

    def forget(self, pages: tuple[int, ...]) -> None:
        if self.rows is None:
            return
        for page in pages:
            self.valid[page * self.page_size : (page + 1) * self.page_size] = False

    def reset(self, request_id: str, start: int, token_ids: list[int], pages: list[int | None]) -> None:
        if start and self.rows is not None:
            flat = self._flat(pages, 0, start)
            if flat is not None and bool(self.valid[flat].all()):  # recompute the depths over the cached prefix
                self.states[request_id] = self._fresh(request_id, 0)
                self._recompute(request_id, self.rows.index_select(0, flat), token_ids)
                return
        # No prefix, or its rows are unknown (loaded from the shared tier): the depths start at `start`.
        self.states[request_id] = self._fresh(request_id, start)

    def _recompute(self, request_id: str, hidden: torch.Tensor, token_ids: list[int]) -> None:
        """Run every depth over the trunk rows `hidden` of positions 0.. (a cached prefix)."""
        self.extend([DraftInput(request_id, 0, hidden, token_ids, False)])

    def _fresh(self, request_id: str, start: int) -> _DrafterState:
        """A request's drafter state whose depths all begin at row `start`."""
        n = self.num_depths
        return _DrafterState(self.drafter.new_state(), [start] * n, [None] * n, [None] * n)

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self.probs.pop(request_id, None)

    def extend(self, inputs: list[DraftInput]) -> dict[str, tuple[int, ...]]:
        work = []
        for item in inputs:
            st = self.states[item.request_id]
            assert item.first_row == st.committed[0], (
                f"request {item.request_id}: trunk rows from {item.first_row}, depth 0 at {st.committed[0]}"
            )
            last = item.first_row + item.hidden.shape[0]  # one past the trunk's last row L
            assert item.draft <= (last == len(item.token_ids) - 1), "drafting needs the token after the last row"
            work.append((item, st))
        drafts: dict[str, list[int]] = {item.request_id: [] for item, _ in work if item.draft}
        depth = min(self.depth_for(len(drafts)), self.num_depths) if drafts else 0  # the depths that draft
        for item, _ in work:
            self.probs.pop(item.request_id, None)
        incoming = {item.request_id: item.hidden for item, _ in work}  # g_{d-1} of this round's new rows
        for d in range(self.num_depths):
            committed_part, provisional_part = [], []
            for item, st in work:
                if st.saved[d] is not None:
                    _restore(st.state.layers[d], st.saved[d])
                rows, start, reach, end = _depth_rows(item, st, incoming, d)
                tokens = list(item.token_ids) + drafts.get(item.request_id, [])
                committed_part.append((item, st, start, end, rows[: end - start], tokens))
                if item.draft and d < depth and end < reach:
                    provisional_part.append((item, st, end, reach, rows[end - start :], tokens))
                # Committed rows of depth d - 1 this depth cannot commit yet wait for its next round.
                above = st.committed[d - 1] if d else end
                st.pending[d] = rows[end - start : above - start] if above > end else None
            out_c = self._run(d, committed_part)
            for _, st, _, end, _, _ in committed_part:
                st.saved[d] = _save(st.state.layers[d])
                st.committed[d] = end
            out_p = dict(zip([p[0].request_id for p in provisional_part], self._run(d, provisional_part), strict=True))
            heads = []
            for (item, *_), g in zip(committed_part, out_c, strict=True):
                rid = item.request_id
                incoming[rid] = torch.cat([g, out_p[rid]]) if rid in out_p else g
                if item.draft and d < depth:
                    heads.append((rid, incoming[rid][-1], item))
            if heads:
                logits = self.drafter.logits(torch.stack([h for _, h, _ in heads]))  # [N, Vu]
                picks = []
                for (rid, _, item), row, token in zip(heads, logits, logits.argmax(-1).tolist(), strict=True):
                    if item.temperature > 0:  # spec 7.4: the same scaled logits give the draft distribution
                        q = torch.softmax(row / item.temperature, -1)
                        token = int(torch.multinomial(q, 1, generator=item.generator))
                        self.probs.setdefault(rid, []).append(q)
                    picks.append(token)
                for (rid, _, _), token in zip(heads, _leader_picks(self.drafter, picks), strict=True):
                    drafts[rid].append(token)
        return {rid: tuple(tokens) for rid, tokens in drafts.items()}

    def _run(self, depth: int, parts: list) -> list[torch.Tensor]:
        """One packed forward of `depth` over each part's rows [start, end) -> each part's output `[end - start, H]`."""
        live = [p for p in parts if p[3] > p[2]]
        if not live:
            return [p[4][:0] for p in parts]
        device = live[0][4].device
        token_ids, slices, hidden = [], [], []
        for _, st, start, end, rows, tokens in live:
            token_ids.extend(tokens[start + depth + 1 : end + depth + 1])
            slices.append(SequenceSlice(start, end - start, st.state.layers))
            hidden.append(rows)
        batch = ForwardBatch(torch.tensor(token_ids, dtype=torch.int64, device=device), slices)
        out = self.drafter(depth, torch.cat(hidden).to(self.drafter.embed.weight.dtype), batch)
        pieces = iter(out.split([p[3] - p[2] for p in live]))
        return [next(pieces) if p[3] > p[2] else p[4][:0] for p in parts]


class PagedMTPSpeculator(MTPSpeculator):
    """The same rounds over the depths' paged pools (`draft_graphs.DepthPools`). A verify round (every request
    drafting, at most `max_first + j` rows per request at depth j) is one `DraftGraphs.run`: each depth's
    committed and provisional rows of every request in one multi-row paged step, then its draft, from a CUDA graph
    per (batch bucket, D, R). Larger rounds run each depth's committed rows as one packed forward, then the same
    graph for the provisional rows only. The drafter needs the paged decode kernels
    (`fast_path.supports_batched_decode` of its trunk). `depth_for(batch)`: the drafts per round for a round of
    that many drafting requests (`num_depths` when not given); the depths past it only queue their rows
    (`pending`, at most `_MAX_LAG`) until a round needs them."""

    def __init__(
        self,
        drafter: MTPDrafter,
        num_depths: int,
        pools: DepthPools,
        graphs: DraftGraphs,
        depth_for: Callable[[int], int] | None = None,
    ):
        super().__init__(drafter, num_depths)
        self.pools, self.graphs = pools, graphs
        if depth_for is not None:
            self.depth_for = depth_for
        self.paged: dict[str, DepthSequence] = {}
        self.stopped: set[str] = set()  # requests whose depth pages ran out: no drafts for them

    @classmethod
    def build(
        cls,
        drafter: MTPDrafter,
        num_depths: int,
        trunk: CacheSpec,
        max_chunk: int,
        max_model_len: int,
        use_graphs: bool = True,
        seed: int = 0,
    ) -> PagedMTPSpeculator:
        """Pools for the trunk's sequences (`trunk`: its pool sizes, dtype and device): a conv slot per sequence,
        sliding pages for a window plus a chunk (`max_chunk`, the step's token budget) each, and the trunk's global
        page count plus one page per sequence (depth rows are not shared between requests; a request whose pages
        run out stops speculating), each with the pages `DepthSequence.grow` takes ahead and keeps past the window
        (`AHEAD_PAGES`). Outside the KV budget, like the trunk rows kept for prefix hits."""
        page, seqs = trunk.page_size, trunk.num_conv_slots
        reach = drafter.config.sliding_window - 1 + max(max_chunk, _MAX_LAG) + num_depths + 1
        sliding = seqs * (math.ceil(reach / page) + 2 + 2 * AHEAD_PAGES)
        spec = CacheSpec(
            page, sliding, trunk.num_global_pages + seqs * (1 + AHEAD_PAGES), seqs, trunk.dtype, trunk.device
        )
        pools = DepthPools(drafter, spec, max_model_len, num_depths)
        graphs = DraftGraphs(drafter, pools, seqs, max_model_len, use_graphs, seed)
        graphs.capture_all([num_depths], list(range(num_depths + 2)))  # fewer drafts (`depth_for`): on first use
        return cls(drafter, num_depths, pools, graphs)

    def reset(self, request_id: str, start: int, token_ids: list[int], pages: list[int | None]) -> None:
        self.remove(request_id)
        seq = self.pools.new_sequence()
        if seq is None:
            logger.warning("request %s: no free MTP depth slot; it runs without speculation", request_id)
            self.stopped.add(request_id)
            return
        self.paged[request_id] = seq
        super().reset(request_id, start, token_ids, pages)

    def _fresh(self, request_id: str, start: int) -> _DrafterState:
        n = self.num_depths
        return _DrafterState(self.paged[request_id], [start] * n, [None] * n, [None] * n)

    def _recompute(self, request_id: str, hidden: torch.Tensor, token_ids: list[int]) -> None:
        """In chunks of `_MAX_LAG` rows, so a sliding depth never holds more than a window and a chunk of pages."""
        for start in range(0, hidden.shape[0], _MAX_LAG):
            rows = hidden[start : start + _MAX_LAG]
            self.extend([DraftInput(request_id, start, rows, token_ids, False)])

    def remove(self, request_id: str) -> None:
        super().remove(request_id)
        self.stopped.discard(request_id)
        seq = self.paged.pop(request_id, None)
        if seq is not None:
            seq.release()

    def extend(self, inputs: list[DraftInput]) -> dict[str, tuple[int, ...]]:
        work, num_drafting, lagging = [], 0, False
        states, paged, probs = self.states, self.paged, self.probs
        for item in inputs:
            rid = item.request_id
            if rid in self.stopped:
                continue
            st = states[rid]
            committed, queue = st.committed, st.pending[0]
            seen = committed[0] if queue is None else committed[0] + queue.shape[0]  # depth 0's, committed and queued
            assert item.first_row == seen, f"request {rid}: trunk rows from {item.first_row}, depth 0 has {seen}"
            last = seen + item.hidden.shape[0]  # one past the trunk's last row
            assert item.draft <= (last == len(item.token_ids) - 1), "drafting needs the token after the last row"
            if not paged[rid].grow(last, min(committed)):
                logger.warning("request %s: MTP depth pages exhausted; it runs without speculation", rid)
                self.remove(rid)
                self.stopped.add(rid)
                continue
            if probs:
                probs.pop(rid, None)
            work.append((item, st))
            num_drafting += item.draft
            # Depths past the round's drafts only queue the rows of the depth before them, up to _MAX_LAG rows (so
            # a sliding depth's pages stay bounded); rounds without drafts (prefill) run every depth.
            lagging = lagging or seen - committed[-1] > _MAX_LAG
        depth = min(self.depth_for(num_drafting), self.num_depths) if num_drafting else 0
        needed = depth if num_drafting and not lagging else self.num_depths
        if depth and not lagging and num_drafting == len(work):  # a verify round: one graph for all of it
            drafts = self._graphed_round(depth, work)
            if drafts is not None:
                return drafts
        drafting = [(item, st) for item, st in work if item.draft]
        heads = self._packed_catch_up(needed, work)
        if not depth:
            return {item.request_id: () for item, _ in drafting}
        return self._chain(depth, drafting, heads)

    def _packed_catch_up(self, needed: int, work: list) -> dict[str, torch.Tensor]:
        """Each depth's committed rows of every request in one packed forward (any row counts); depths from
        `needed` on queue their input rows. -> depth 0's last output row of each drafting request."""
        incoming = {item.request_id: item.hidden for item, _ in work}  # g_{d-1} of this round's committed rows
        heads: dict[str, torch.Tensor] = {}
        for d in range(self.num_depths):
            if d >= needed:
                for item, st in work:
                    rows = incoming[item.request_id]
                    if rows.shape[0]:
                        st.pending[d] = rows if st.pending[d] is None else torch.cat([st.pending[d], rows])
                break
            parts = []
            for item, st in work:
                rows, start, reach, end = _depth_rows(item, st, incoming, d)
                parts.append((item, st, start, end, rows[: end - start], item.token_ids))
                above = st.committed[d - 1] if d else end
                st.pending[d] = rows[end - start : above - start] if above > end else None
            for (item, st, _, end, _, _), out in zip(parts, self._run(d, parts), strict=True):
                st.committed[d] = end
                incoming[item.request_id] = out
                if d == 0 and item.draft:
                    heads[item.request_id] = out[-1]
        return heads

    def _graphed_round(self, depth: int, work: list) -> dict[str, tuple[int, ...]] | None:
        """A round whose drafting depths take at most `max_first + j` rows (committed and provisional) per request
        at depth j (a verify round) as one `DraftGraphs.run`: every depth's rows in one multi-row step, then its
        draft. None: not taken (more rows; the caller runs the packed catch-up and `_chain`). Its plan (`_Plan`)
        is built as arrays over the batch from `_ARRAYS_FROM` requests on, per request below (numpy's per-call cost
        would dominate a small round)."""
        graphs = self.graphs
        build = _plan_arrays if len(work) >= _ARRAYS_FROM else _plan_lists
        plan = build(work, depth, self.num_depths, graphs.buckets[-1], graphs.max_rows, graphs.max_first)
        if plan is None:
            return None
        index = to_device(plan.index, graphs.inputs.device)  # one upload for the targets and the kept rows
        h, targets = self.drafter.config.hidden_size, plan.num_targets
        graphs.inputs.view(-1, h).index_copy_(0, index[:targets], torch.cat(plan.sources).to(graphs.inputs.dtype))
        drafts, q = self._launch_round(depth, plan.first, work, plan.rows)
        # While the round runs: the rows kept (gathered after it), the depths' new state.
        kept = graphs.flat.index_select(0, index[targets:]).split([k for counts in plan.kept for k in counts])
        ends, at = (plan.rows.start + plan.rows.count).tolist(), 0
        lagging = []  # (state, old queue, its new rows) of the depth past the drafts
        for (_, st), end, counts in zip(work, ends, plan.kept, strict=True):
            pending = st.pending
            pending[0] = None
            st.committed[:depth] = end
            for d, k in enumerate(counts, 1):
                if d == depth:
                    lagging.append((st, pending[d], kept[at]))
                else:
                    pending[d] = kept[at] if k else None
                at += 1
        if any(old is not None for _, old, _ in lagging):  # old rows first: one copy for all the queues
            pieces = [p for _, old, new in lagging for p in ((old, new) if old is not None else (new,))]
            queue, at = torch.cat(pieces), 0
            for st, old, new in lagging:
                k = new.shape[0] + (old.shape[0] if old is not None else 0)
                st.pending[depth], at = (queue[at : at + k] if k else None), at + k
        else:
            for st, _, new in lagging:
                st.pending[depth] = new if new.shape[0] else None
        return self._read_drafts(work, drafts, q)

    def _chain(self, depth: int, drafting: list, heads: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
        """After the packed catch-up: the provisional rows and the drafts of the drafting requests (a
        `DraftGraphs.run` without depth-0 rows, depth 0's last row given)."""
        graphs, h = self.graphs, self.drafter.config.hidden_size
        width, r = graphs.buckets[-1], graphs.max_rows
        sources, targets, b = [], [], len(drafting)
        known, start = np.zeros(b, dtype=np.int64), np.zeros((b, depth), dtype=np.int64)
        shift, tokens = np.zeros((b, depth), dtype=np.int64), np.zeros((b, depth, r), dtype=np.int64)
        for i, (item, st) in enumerate(drafting):
            known[i], start[i] = len(item.token_ids), st.committed[:depth]
            for j in range(1, depth):
                if st.pending[j] is not None:  # g_{j-1}(p) committed, p = c_j .. c_{j-1} - 1
                    shift[i, j] = st.pending[j].shape[0]
                    sources.append(st.pending[j])
                    targets.extend(range(j * r * width + i, (j * r + shift[i, j]) * width, width))
            for j, row in enumerate(_known_tokens(item.token_ids, start[i].tolist())):
                tokens[i, j, : len(row)] = row
        total = known[:, None] - 1 - start
        rounds = RoundRows(known, start, np.zeros_like(start), total, shift, tokens)
        head = torch.stack([heads[item.request_id] for item, _ in drafting])  # g_0(K-2) of each request
        graphs.outputs[0, 0, : len(drafting)].copy_(head)
        if targets:
            index = to_device(targets, graphs.inputs.device)
            graphs.inputs.view(-1, h).index_copy_(0, index, torch.cat(sources).to(graphs.inputs.dtype))
        return self._read_drafts(drafting, *self._launch_round(depth, 0, drafting, rounds))

    def _launch_round(
        self, depth: int, first: int, work: list, rounds: RoundRows
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Start the round on the device (`DraftGraphs.run`) -> its drafts `[depth, B]` and `q`, not read yet."""
        temperatures = [item.temperature for item, _ in work]
        generators = [item.generator for item, _ in work]
        slots = [st.state.slot for _, st in work]
        return self.graphs.run(depth, first, rounds, slots, temperatures, generators)

    def _read_drafts(self, work: list, drafts: torch.Tensor, q: torch.Tensor | None) -> dict[str, tuple[int, ...]]:
        """The round's drafts per request (the host waits for the round here); the sampled rows' `q` kept."""
        out = {}
        for i, ((item, _), tokens) in enumerate(zip(work, drafts.t().tolist(), strict=True)):
            out[item.request_id] = tuple(tokens)
            if item.temperature > 0:
                self.probs[item.request_id] = list(q[:, i].clone())
        return out


def _depth_rows(item, st: _DrafterState, incoming: dict[str, torch.Tensor], d: int):
    """Depth d's input rows this round (its queued rows, then the incoming ones), the position they start at,
    the one they reach, and the end of the rows whose token is known."""
    rows = incoming[item.request_id]
    if st.pending[d] is not None:
        rows = torch.cat([st.pending[d], rows])
    start = st.committed[d]
    reach = start + rows.shape[0]
    end = max(start, min(reach, len(item.token_ids) - 1 - d))
    return rows, start, reach, end


def _known_tokens(token_ids: Sequence[int], start: list[int]) -> list[list[int]]:
    """Per depth j, the token of each of its rows `start[j] .. K-2`: the one at position p + j + 1 when known
    (< K), else 0 (a draft of this round, filled in on the device)."""
    k = len(token_ids)
    tokens = []
    for j, s in enumerate(start):
        known = token_ids[s + j + 1 : k]
        tokens.append(known + [0] * (k - 1 - s - len(known)))
    return tokens


_ARRAYS_FROM = 8  # requests from which a graphed round's plan is built as arrays (host time, see decisions.md)


@dataclass(frozen=True)
class _Plan:
    """A graphed round's host side: its rows, `first` (R), the host rows (`sources`) and their flat rows in
    `graphs.inputs` (`index[:num_targets]`), then the flat rows of `graphs.flat` each depth d >= 1 keeps
    (`pending`, `index[num_targets:]`), `kept[i][d - 1]` of them for request i (request-major, depth-minor)."""

    rows: RoundRows
    first: int
    sources: list[torch.Tensor]
    index: Sequence[int]
    num_targets: int
    kept: list[list[int]]


def _plan_lists(work: list, depth: int, n: int, width: int, r: int, max_first: int) -> _Plan | None:
    """`_Plan` of a round, per request in Python lists (small rounds)."""
    outputs = n * r * width  # flat row of `outputs[0, 0, 0]`
    fields, tokens, sources, targets, picks, kept, first = ([], [], [], [], []), [], [], [], [], [], 0
    for i, (item, st) in enumerate(work):
        k, pending = len(item.token_ids), st.pending
        start = st.committed[:depth]
        total = [k - 1 - s for s in start]  # every depth's rows reach K-2
        count = [max(0, t - j) for j, t in enumerate(total)]  # rows whose token is known
        queued = [0 if p is None else p.shape[0] for p in pending[:depth]]
        shift = [total[0]] + queued[1:]
        assert total[0] == queued[0] + item.hidden.shape[0], "depth 0 gets its queue and the trunk's rows"
        assert all(total[j] == total[j - 1] + queued[j] for j in range(1, depth)), "depth j gets depth j-1's rows"
        first = max(first, *(t - j for j, t in enumerate(total)))
        for field, values in zip(fields, ([k], start, count, total, shift), strict=True):
            field.append(values)
        for j, s in enumerate(start):
            known = item.token_ids[s + j + 1 : k]
            tokens += known
            tokens += [0] * (r - len(known))
        sources.extend(pending[:1] if pending[0] is not None else ())
        sources.append(item.hidden)
        sources.extend(p for p in pending[1:depth] if p is not None)
        for j in range(depth):
            targets.extend(range(j * r * width + i, (j * r + shift[j]) * width, width))
        counts = []
        for j in range(1, min(depth + 1, n)):  # see `_plan_arrays`
            lo, hi, s = (count[j], start[j - 1] + count[j - 1] - start[j], shift[j]) if j < depth else (0, count[-1], 0)
            picks.extend(range((j * r + lo) * width + i, (j * r + min(hi, s)) * width, width))
            at = outputs + ((j - 1) * r + max(lo, s) - s) * width + i
            picks.extend(range(at, at + max(0, hi - max(lo, s)) * width, width))
            counts.append(max(0, hi - lo))
        kept.append(counts)
    if first > max_first:
        return None
    known, start, count, total, shift = (np.array(f, dtype=np.int64).reshape(len(work), -1) for f in fields)
    tokens = np.array(tokens, dtype=np.int64).reshape(len(work), depth, r)
    rows = RoundRows(known[:, 0], start, count, total, shift, tokens)
    return _Plan(rows, first, sources, targets + picks, len(targets), kept)


def _plan_arrays(work: list, depth: int, n: int, width: int, r: int, max_first: int) -> _Plan | None:
    """`_Plan` of a round as arrays over the batch: per request only its lists are read, in one pass."""
    b, w = len(work), max_first + 1
    known, start, queued, arriving, tail, sources = [], [], [], [], [], []
    for item, st in work:
        tokens, pending, hidden = item.token_ids, st.pending[:depth], item.hidden
        k = len(tokens)
        known.append(k)  # K
        start += st.committed[:depth]
        arriving.append(hidden.shape[0])
        tail += tokens[k - w :] if k >= w else _last(tokens, w)
        # The host rows: depth 0's (its queue, then the trunk's), then each depth's queue, into `inputs[j, m, i]`
        # (`m < shift`), request-major.
        for d, q in enumerate(pending):
            if q is None:
                queued.append(0)
            else:
                queued.append(q.shape[0])
                sources.append(q)
            if not d:
                sources.append(hidden)
    known = np.array(known, dtype=np.int64)
    start = np.array(start, dtype=np.int64).reshape(b, depth)
    queued = np.array(queued, dtype=np.int64).reshape(b, depth)
    total = known[:, None] - 1 - start  # [B, D] every depth's rows reach K-2
    assert (total[:, 0] == queued[:, 0] + arriving).all() and (total[:, 1:] == total[:, :-1] + queued[:, 1:]).all()
    j = np.arange(depth)
    count = np.maximum(0, total - j)  # rows whose token is known: positions < K-1-j
    first = int((total - j).max())
    if first > max_first:
        return None
    shift = queued.copy()
    shift[:, 0] = total[:, 0]
    # Tokens: row m of depth j is position start + m, its token the one at position start + m + j + 1 when
    # known (< K); every such position is among the last `w` (a graphed round starts no depth earlier).
    m = np.arange(r)
    p = (start + j)[:, :, None] + (m + 1)  # [B, D, R]
    at = np.minimum(p - known[:, None, None] + w, w - 1).reshape(b, -1)  # >= 1: total - j <= first < w
    tokens = np.array(tail, dtype=np.int64).reshape(b, w)[np.arange(b)[:, None], at].reshape(b, depth, r)
    tokens[(p >= known[:, None, None]) | (m >= total[:, :, None])] = 0
    i, d, row = np.nonzero(m < shift[:, :, None])  # request-major, as the sources
    targets = (d * r + row) * width + i
    # The rows each depth d >= 1 keeps (`pending`), per request: depth d's input rows count .. (depth d-1's new
    # committed end) - 1 (queued rows, still in `inputs`, then depth d-1's outputs of this round); the depth past
    # the drafts keeps its queue and depth d-1's committed rows (`lo` = `s` = 0, `hi` = the count).
    lo, s, hi = (np.zeros((b, min(depth, n - 1)), dtype=np.int64) for _ in range(3))
    lo[:, : depth - 1], s[:, : depth - 1] = count[:, 1:], shift[:, 1:]
    hi[:, : depth - 1] = start[:, :-1] + count[:, :-1] - start[:, 1:]
    if depth < n:
        hi[:, -1] = count[:, -1]
    i, c, row = np.nonzero((m >= lo[:, :, None]) & (m < hi[:, :, None]))
    s = s[i, c]
    picks = np.where(row < s, (c + 1) * r + row, n * r + c * r + row - s) * width + i
    kept = np.maximum(0, hi - lo).tolist()
    rows = RoundRows(known, start, count, total, shift, tokens)
    return _Plan(rows, first, sources, np.concatenate([targets, picks]), len(targets), kept)


def _last(token_ids: Sequence[int], w: int) -> list[int]:
    """The last `w` tokens, zeros before a shorter sequence's first."""
    k = len(token_ids)
    return [0] * (w - k) + token_ids[:] if k < w else token_ids[k - w :]
