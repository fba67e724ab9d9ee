"""The control plane alone: no model, no tensors, no device. Each step 'computes' the scheduled tokens and samples
token 1; the checks read the plain-data `SchedulerOutput` (chunks, page updates, conv ops)."""

from __future__ import annotations

import pickle
import subprocess
import sys

from decode_service.engine.core.outputs import DROP, RESTORE, SNAPSHOT, ZERO, SchedulerOutput
from decode_service.engine.core.pages import KVAllocator, PoolSizes
from decode_service.engine.core.prefix_index import PrefixCache
from decode_service.engine.core.prefix_tier import TierHit
from decode_service.engine.core.scheduler import Scheduler, SchedulerConfig
from decode_service.engine.request import PENDING_TOKEN, FinishReason, Request, RequestStatus, SamplingParams

CONTROL_PLANE = (
    "decode_service.engine.core.scheduler",
    "decode_service.engine.core.pages",
    "decode_service.engine.core.prefix_index",
    "decode_service.engine.core.prefix_tier",
    "decode_service.engine.core.outputs",
    "decode_service.engine.core.stop",
    "decode_service.engine.request",
)


def make(
    config, *, pages: int = 64, budget: int = 16, seqs: int = 4, page_size: int = 4, prefix: bool = False
) -> Scheduler:
    cache = KVAllocator(config, PoolSizes(page_size, pages, pages, seqs))
    prefix_cache = PrefixCache(cache, b"model", snapshot_interval_blocks=2) if prefix else None
    return Scheduler(cache, SchedulerConfig(budget, seqs), prefix_cache)


def request(rid: str, n: int, max_tokens: int = 4, priority: int = 0, offset: int = 10) -> Request:
    return Request(
        rid,
        list(range(offset, offset + n)),
        SamplingParams(temperature=0.0, max_tokens=max_tokens),
        priority=priority,
    )


def fake_step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    live = {c.request_id: s.live[c.request_id] for c in out.chunks}
    s.commit(out)
    for chunk in out.chunks:
        r = live[chunk.request_id]
        if chunk.needs_logits:
            r.output_token_ids.append(1)
            if len(r.output_token_ids) >= r.sampling.max_tokens:
                s.finish(r, FinishReason.LENGTH)
    return out


def run_all(s: Scheduler, limit: int = 500) -> list[SchedulerOutput]:
    outs = []
    while s.has_unfinished:
        outs.append(fake_step(s))
        assert len(outs) < limit, "scheduler made no progress"
    return outs


def assert_cache_empty(s: Scheduler) -> None:
    cache = s.cache
    if s.prefix_cache is not None:
        s.prefix_cache.clear()
    assert cache.num_free_pages(True) == cache.pools[True].num_pages
    assert cache.num_free_pages(False) == cache.pools[False].num_pages
    assert cache.num_free_slots == cache.spec.num_conv_slots


def test_the_control_plane_imports_no_torch():
    code = f"import sys\nfor m in {CONTROL_PLANE!r}: __import__(m)\nprint('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_budget_mixes_decodes_with_chunked_prefill(model_config):
    s = make(model_config.text, budget=16)
    reqs = [request(r, 10) for r in "abc"]
    for r in reqs:
        s.add(r)
    outs = run_all(s)
    assert all(o.num_tokens <= 16 for o in outs)
    first = outs[0]
    assert [(c.request_id, c.num_tokens, c.start) for c in first.chunks] == [("a", 10, 0), ("b", 6, 0)]
    assert first.chunks[0].needs_logits and not first.chunks[1].needs_logits
    assert first.chunks[0].token_ids == tuple(range(10, 20))
    second = outs[1]
    assert [(c.request_id, c.num_tokens, c.start) for c in second.chunks] == [("a", 1, 10), ("b", 4, 6), ("c", 10, 0)]
    assert second.chunks[0].token_ids == (1,)  # the token sampled last step
    assert all(r.status is RequestStatus.FINISHED and r.finish_reason is FinishReason.LENGTH for r in reqs)
    assert_cache_empty(s)


def test_chunks_carry_slots_and_page_updates_that_replay_the_tables(model_config):
    s = make(model_config.text, budget=16, page_size=4)  # window 8: sliding pages are released as it decodes
    a = request("a", 10, max_tokens=50)
    s.add(a)
    first = fake_step(s)
    (chunk,) = first.chunks
    assert chunk.new_sequence and chunk.global_pages.first == 0 and len(chunk.global_pages.pages) == 3
    assert first.conv_ops == ((ZERO, chunk.slot, None),)
    tables = {True: list(chunk.sliding_pages.pages), False: list(chunk.global_pages.pages)}
    freed = 0
    for step in range(13):  # decodes at positions 10..22; the last one is scheduled but not committed
        out = fake_step(s) if step < 12 else s.schedule()
        (c,) = out.chunks
        assert not c.new_sequence and c.slot == chunk.slot and c.needs_logits and c.start == 10 + step
        for sliding, update in ((True, c.sliding_pages), (False, c.global_pages)):
            assert update.first == len(tables[sliding])
            tables[sliding] = [None if p in update.freed else p for p in tables[sliding]] + list(update.pages)
        freed += len(c.sliding_pages.freed)
    assert freed and tables == a.handle.tables
    s.abort("a")
    s.schedule()
    assert_cache_empty(s)


def test_max_num_seqs_and_priority(model_config):
    s = make(model_config.text, budget=64, seqs=2)
    late_urgent = request("urgent", 4, priority=-1)
    for r in [request("a", 4), request("b", 4), late_urgent]:
        s.add(r)
    out = fake_step(s)
    assert [c.request_id for c in out.chunks] == ["urgent", "a"]
    assert len(s.running) == 2 and [r.request_id for r in s.waiting] == ["b"]
    run_all(s)
    assert_cache_empty(s)


def test_abort_takes_effect_at_the_step_boundary(model_config):
    s = make(model_config.text, budget=64, seqs=1)
    running, waiting = request("run", 4, max_tokens=50), request("wait", 4)
    s.add(running)
    s.add(waiting)
    fake_step(s)
    s.abort("run")
    s.abort("wait")
    assert running.status is RequestStatus.RUNNING  # nothing happens until the next schedule
    out = s.schedule()
    assert set(out.finished) == {"run", "wait"}
    assert running.finish_reason_text == "abort" and waiting.finish_reason_text == "abort"
    assert not out.chunks and not s.has_unfinished and not s.live
    assert_cache_empty(s)


def test_preemption_by_recompute_under_a_tiny_budget(model_config):
    # 8 global pages of 4 tokens = 32 tokens of history for everybody together.
    s = make(model_config.text, pages=8, budget=16, seqs=4)
    reqs = [request(f"r{i}", 7, max_tokens=9) for i in range(4)]
    for r in reqs:
        s.add(r)
    outs = run_all(s)
    assert sum(len(o.preempted) for o in outs) > 0
    for r in reqs:
        assert r.finish_reason is FinishReason.LENGTH and len(r.output_token_ids) == 9
    preempted = next(r for r in reqs if r.num_preemptions)
    # After preemption the request recomputes prompt + generated tokens from position 0, on a fresh sequence.
    recompute = next(
        c for o in outs for c in o.chunks if c.request_id == preempted.request_id and c.start == 0 and c.token_ids[7:]
    )
    assert recompute.new_sequence and recompute.global_pages.first == 0
    assert list(recompute.token_ids[:7]) == preempted.prompt_token_ids
    assert set(recompute.token_ids[7:]) == {1}
    assert_cache_empty(s)


def test_request_larger_than_the_cache_finishes_with_an_error(model_config):
    s = make(model_config.text, pages=4, budget=16, seqs=2)  # 16 tokens of global history at most
    too_long = request("long", 20)
    grows_too_long = request("grow", 10, max_tokens=50)
    s.add(too_long)
    s.add(grows_too_long)
    run_all(s)
    assert too_long.finish_reason_text.startswith("error:")
    assert grows_too_long.finish_reason_text.startswith("error:") and grows_too_long.output_token_ids
    assert_cache_empty(s)


def test_prefix_hits_restore_the_snapshot_taken_by_the_first_request(model_config):
    """Snapshots are planned at tracked boundaries (every 2 blocks of 4 and the prompt's last block start) and named
    by id; a later request with the same prompt adopts the pages and restores the snapshot at its hit."""
    s = make(model_config.text, budget=64, prefix=True)
    s.add(request("a", 19, max_tokens=2))
    outs = run_all(s)
    snaps = {c.end: c.snapshot_id for o in outs for c in o.chunks if c.snapshot_id is not None}
    assert sorted(snaps) == [8, 16]  # 16 is also (19 - 1) // 4 * 4
    ops = [op for o in outs for op in o.conv_ops if op.kind == SNAPSHOT]
    assert {op.snapshot_id for op in ops} == set(snaps.values())

    b = request("b", 19, max_tokens=2)
    s.add(b)
    out = fake_step(s)
    (chunk,) = out.chunks
    assert chunk.start == 16 and b.num_cached_tokens == 16
    assert len(chunk.global_pages.pages) == 5  # 4 adopted + 1 grown
    assert [op.kind for op in out.conv_ops] == [ZERO, RESTORE]
    assert out.conv_ops[1].snapshot_id == snaps[16] and out.conv_ops[1].slot == chunk.slot
    run_all(s)

    s.prefix_cache.evict((0, s.cache.pools[False].num_pages))  # everything is unreferenced now
    s.add(request("c", 5, offset=70))
    dropped = {op.snapshot_id for op in s.schedule().conv_ops if op.kind == DROP}
    assert dropped == set(snaps.values())


def test_scheduler_output_pickles(model_config):
    s = make(model_config.text, budget=64, prefix=True)
    s.add(request("a", 19, max_tokens=2))
    run_all(s)
    s.add(request("b", 19, max_tokens=2))
    out = s.schedule()
    assert out.chunks and out.conv_ops
    again = pickle.loads(pickle.dumps(out))
    assert again == out and again is not out


class FakeTier:
    """A shared tier that holds every prompt's first `blocks` blocks."""

    def __init__(self, blocks: int):
        self.blocks = blocks
        self.lookups: list[tuple[int, int]] = []

    def lookup(self, block_hashes, start_block):
        self.lookups.append((len(block_hashes), start_block))
        return TierHit(41, self.blocks) if self.blocks > start_block else None


def test_the_shared_tier_is_planned_as_saves_and_loads(model_config):
    cache = KVAllocator(model_config.text, PoolSizes(4, 64, 64, 4))
    prefix = PrefixCache(cache, b"model", snapshot_interval_blocks=2)
    tier = FakeTier(blocks=2)
    s = Scheduler(cache, SchedulerConfig(64, 4), prefix, tier)
    a = request("a", 19, max_tokens=2)
    s.add(a)
    out = s.schedule()
    assert tier.lookups == [(4, 0)]  # (19 - 1) // 4 blocks may come from a cache
    (load,) = out.prefix_tier.loads
    assert (load.load_id, load.start_block, load.end_block) == (41, 0, 2) and len(load.global_pages) == 2
    assert load.sliding_first == 0 and len(load.sliding_pages) == 2  # the window of 8 (W = 8) covers both blocks
    (chunk,) = out.chunks
    assert (chunk.start, chunk.end) == (8, 16)  # up to the next tracked boundary
    assert chunk.global_pages.pages[:2] == load.global_pages and chunk.sliding_pages.pages[:2] == load.sliding_pages
    zero, restore, snapshot = out.conv_ops
    assert (zero.kind, restore.kind, snapshot.kind) == (ZERO, RESTORE, SNAPSHOT)
    assert restore.snapshot_id == load.snapshot_id and snapshot.snapshot_id == chunk.snapshot_id
    (save,) = out.prefix_tier.saves  # blocks 2 and 3, and the boundary 16 with its window (blocks 2, 3)
    assert [(b.index, b.page) for b in save.blocks] == [
        (2, chunk.global_pages.pages[2]),
        (3, chunk.global_pages.pages[3]),
    ]
    assert save.boundary.boundary == 16 and save.boundary.sliding_pages == chunk.sliding_pages.pages[2:4]
    assert save.blocks[1].block_hash == save.boundary.block_hash == prefix.block_hashes(a, 4)[3]
    assert pickle.loads(pickle.dumps(out)) == out
    s.commit(out)
    assert a.num_cached_tokens == 8 and s.num_cached_tokens_redis == {"a": 8}
    b = request("b", 19, max_tokens=2)
    s.add(b)
    assert s.schedule().chunks[-1].start == 16  # the GPU index now holds the loaded and the computed blocks


def test_an_abandoned_step_drops_the_snapshots_it_planned(model_config):
    s = make(model_config.text, budget=64, prefix=True)
    a = request("a", 19, max_tokens=2)
    s.add(a)
    out = s.schedule()
    planned = {c.snapshot_id for c in out.chunks if c.snapshot_id is not None}
    assert planned
    s.abandon(out)  # the data plane failed: the caller finishes the step's requests
    s.finish(a, FinishReason.ERROR, "forward failed")
    s.add(request("b", 3))
    dropped = {op.snapshot_id for op in s.schedule().conv_ops if op.kind == DROP}
    assert dropped == planned and not s.prefix_cache.entries


def prefilled(s: Scheduler, r: Request) -> None:
    s.add(r)
    while not r.output_token_ids:
        fake_step(s)


def test_verify_chunks_commit_only_the_accepted_rows(model_config):
    """Drafts ride on the decode chunk; the scheduler commits the accepted count only, so a sliding page still
    inside the window of the committed end stays allocated (window 8, page 4)."""
    s = make(model_config.text, budget=16)
    r = request("v", 10, max_tokens=20)
    prefilled(s, r)
    r.draft_token_ids = (5, 6, 7)
    out = s.schedule()
    (chunk,) = out.chunks
    assert (chunk.start, chunk.token_ids, chunk.num_drafts, chunk.needs_logits) == (10, (1, 5, 6, 7), 3, True)
    assert chunk.snapshot_id is None and r.draft_token_ids == ()
    assert len(r.handle.tables[False]) == 4  # pages for positions 10..13 were reserved
    s.commit(out, {"v": 2})  # the bonus and d_1 committed, d_2 rejected
    assert r.num_computed_tokens == 12 and r.handle.num_tokens == 12
    assert r.handle.tables[True][1] is not None  # positions 4..7: inside the window of position 12
    r.output_token_ids += [5, 9]
    nxt = s.schedule()
    assert [(c.start, c.token_ids, c.num_drafts) for c in nxt.chunks] == [(12, (9,), 0)]


def test_drafts_are_capped_and_never_preempt(model_config):
    s = make(model_config.text, budget=16)
    r = request("c", 10, max_tokens=3)
    prefilled(s, r)
    r.draft_token_ids = (5, 6, 7, 8)
    (chunk,) = s.schedule().chunks
    assert chunk.token_ids == (1, 5)  # max_tokens 3, one generated: one draft + the bonus token at most

    tight = make(model_config.text, budget=22, pages=6)  # both prompts fill three pages of each pool
    a, b = request("a", 11, max_tokens=30), request("b", 11, max_tokens=30, offset=40)
    tight.add(a)
    tight.add(b)
    fake_step(tight)
    assert a.output_token_ids and b.output_token_ids and tight.cache.num_free_pages(False) == 0
    a.draft_token_ids = (5, 6, 7, 8, 9)  # position 11 fits the third page, the drafts would need a fourth
    out = tight.schedule()
    assert [(c.request_id, c.num_drafts) for c in out.chunks] == [("a", 0), ("b", 0)] and not out.preempted


def test_pending_tokens_are_planned_as_placeholders_and_a_stop_discards_its_chunk(model_config):
    """Async scheduling: a request with a token in flight is planned one more decode whose token is
    `PENDING_TOKEN`; when it stops before that step is committed, the chunk is skipped and its snapshot dropped."""
    s = make(model_config.text, budget=16, page_size=4, prefix=True)
    a, b = request("a", 7, max_tokens=10), request("b", 6, max_tokens=10)
    s.add(a)
    s.add(b)
    fake_step(s)
    fake_step(s)  # the prefills end: both sampled a token
    first = s.schedule()  # a decode each, launched: its tokens are pending
    s.commit(first)
    for r in (a, b):
        r.num_pending_tokens += 1
    second = s.schedule()  # planned before the first step's tokens are read
    assert [c.token_ids for c in second.chunks] == [(PENDING_TOKEN,), (PENDING_TOKEN,)]
    assert [c.start for c in second.chunks] == [8, 7]  # after the prompt and the sampled token
    assert a.token_slice(0, 9)[-1] == PENDING_TOKEN and PENDING_TOKEN not in a.token_slice(0, 8)
    for r in (a, b):  # the first step's tokens are read: b stops there
        r.num_pending_tokens -= 1
        r.output_token_ids.append(1)
    s.finish(b, FinishReason.STOP)
    assert b.num_pending_tokens == 0 and b.handle is None
    s.commit(second)  # b's chunk is skipped (its pages went back at the stop)
    assert a.num_computed_tokens == 9 and b.num_computed_tokens == 0
    snapshot = second.chunks[1].snapshot_id
    assert snapshot is not None  # b's chunk ended on the tracked boundary at 8: its snapshot is dropped
    assert (DROP, None, snapshot) in s.schedule().conv_ops
