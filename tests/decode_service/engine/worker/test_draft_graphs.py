"""The batched, paged MTP speculator (`PagedMTPSpeculator` + `DraftGraphs`) against the contiguous per-request
`MTPSpeculator` on the same drafter: every round's greedy drafts are equal and the sampled rows' depth-0 `q` is
the same distribution, over prefill chunks, every acceptance length, a short prompt (fewer rows than depths) and
page and window boundaries; the verify rounds' multi-row steps see different (odd) row counts in one batch.
Make-tiny with 4 depths (depth 0 sliding, window 16), fp32, the kernels in the CPU interpreter; the chain runs
eagerly on its static buffers (no CUDA here)."""

from __future__ import annotations

import pytest
import torch

from common.checkpoint import CheckpointFiles, load_decoder_weights, load_mtp_weights
from common.config import load_model_config
from decode_service.engine.worker import mtp
from decode_service.engine.worker.draft_graphs import AHEAD_PAGES, DepthPools, DepthSequence, DraftGraphs
from decode_service.engine.worker.kv_cache import CacheSpec
from decode_service.engine.worker.mtp import DraftInput, MTPSpeculator, PagedMTPSpeculator
from decode_service.model.inkling import InklingDecoder
from decode_service.model.mtp import MTPDrafter
from tools.make_tiny_checkpoint import make_tiny_checkpoint

DEPTHS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mtp4")
    make_tiny_checkpoint(directory, seed=7, mtp_config={"num_nextn_predict_layers": DEPTHS})
    return directory


def build(directory, dtype: torch.dtype = torch.float32, device: str = "cpu", head: str = "bf16") -> tuple:
    """(trunk, drafter, config) of the checkpoint, on the kernels (`fast` ops), drafting through `head`."""
    files, config = CheckpointFiles(directory), load_model_config(directory)
    weights, _ = load_decoder_weights(files, config, dtype=dtype)
    trunk = InklingDecoder.from_weights(config.text, weights, dtype, device).with_ops("fast")
    mtp, _ = load_mtp_weights(files, config, dtype=dtype)
    return trunk, MTPDrafter.from_weights(mtp, config.mtp, trunk, head=head), config


@pytest.fixture(scope="module")
def models(checkpoint) -> tuple:
    return build(checkpoint)


@pytest.fixture(scope="module")
def drafter(models) -> MTPDrafter:
    return models[1]


def paged(drafter: MTPDrafter, depth: int, max_num_seqs: int = 3, use_graphs: bool = True) -> PagedMTPSpeculator:
    weight = drafter.embed.weight
    spec = CacheSpec(4, 64, 64, max_num_seqs, weight.dtype, str(weight.device))
    pools = DepthPools(drafter, spec, max_model_len=128, num_depths=depth)
    return PagedMTPSpeculator(drafter, depth, pools, DraftGraphs(drafter, pools, max_num_seqs, 128, use_graphs))


class Script:
    """Trunk rows and tokens of one request as the runner would feed them: a chunked prompt, then verify rounds
    accepting `accepts[r]` of the round's drafts."""

    def __init__(self, rid: str, prompt: int, chunks: list[int], accepts: list[int], temperature: float, seed: int):
        self.rid, self.gen = rid, torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(4, 200000, (prompt + 1,), generator=self.gen).tolist()
        self.rows = self.step = 0
        self.steps = [(n, False) for n in chunks] + [(prompt - sum(chunks), True)] + [(a + 1, True) for a in accepts]
        self.temperature = temperature

    def input(self, hidden_size: int, drafts: tuple[int, ...], device: torch.device) -> DraftInput | None:
        step, self.step = self.step, self.step + 1
        if step >= len(self.steps):
            return None
        n, draft = self.steps[step]
        if step and self.steps[step - 1][1]:  # a verify round: the accepted drafts, then one new token
            n = min(n, len(drafts) + 1)
            self.tokens += list(drafts[: n - 1]) + torch.randint(4, 200000, (1,), generator=self.gen).tolist()
        hidden = torch.randn(n, hidden_size, generator=self.gen).to(device)
        first, self.rows = self.rows, self.rows + n
        known = self.tokens if draft else self.tokens[: len(self.tokens) - 1]
        gen = torch.Generator(device).manual_seed(step) if self.temperature > 0 else None
        return DraftInput(self.rid, first, hidden, list(known), draft, self.temperature, gen)


def twin(item: DraftInput) -> DraftInput:
    """The same input with its own generator in the state the original's started from."""
    if item.generator is None:
        return item
    generator = torch.Generator(item.generator.device).manual_seed(item.generator.initial_seed())
    return item._replace(generator=generator)


def compare(
    reference, batched, drafter: MTPDrafter, depth: int, exact: bool, schedule: list[int] = (), hot: float = 0.8
) -> list:
    """Drive both speculators with the same rounds; greedy drafts equal, the sampled request's depth-0 `q` close
    (`exact`: every draft and every `q` bitwise equal). `schedule`: the drafts of each round (`depth_for`), else
    `depth`; `hot`: the temperature of the one request that may sample. -> the draft distributions each graphed
    call returned (None: a round of greedy rows only)."""
    device = drafter.embed.weight.device
    at = [0]
    if schedule:
        for spec in (reference, batched):
            spec.depth_for = lambda batch: schedule[at[0] % len(schedule)]
    graphed = []  # (R, RoundRows) of the rounds whose every row ran in the round's graph (a verify round)
    returned = []  # the `q` of every call
    run = batched.graphs.run

    def recording(depth, first, rounds, *args):
        if first:
            graphed.append((first, rounds))
        out = run(depth, first, rounds, *args)
        returned.append(out[1])
        return out

    batched.graphs.run = recording
    scripts = [
        Script("long", 80 if schedule else 21, [] if schedule else [9], [depth, 0, 1, depth, 2, 0], 0.0, 1),
        Script("short", 2, [], [0, 1, depth, 0, 0, 1], 0.0, 2),
        Script("hot", 6, [3], [1, 0, depth, 0, 2, 1], hot, 3),
    ]
    h = drafter.config.hidden_size
    for spec in (reference, batched):
        for s in scripts:
            spec.reset(s.rid, 0, s.tokens, [])
    drafts: dict[str, tuple[int, ...]] = {}
    for step in range(9):
        at[0] = step
        inputs = [i for s in scripts if (i := s.input(h, drafts.get(s.rid, ()), device)) is not None]
        want = reference.extend(inputs)
        got = batched.extend([twin(i) for i in inputs])
        assert set(got) == set(want) == {i.request_id for i in inputs if i.draft}
        for rid, tokens in want.items():
            assert len(got[rid]) == (schedule[step % len(schedule)] if schedule else depth)
            if exact:
                assert got[rid] == tokens, f"step {step} request {rid}"
                q, p = batched.draft_probs(rid), reference.draft_probs(rid)
                assert (q is None) == (p is None) and (q is None or torch.equal(q, p))
            elif rid != "hot" or not hot:
                assert got[rid] == tokens, f"step {step} request {rid}"
                assert batched.draft_probs(rid) is None
            elif tokens:  # sampled drafts: the same distribution at depth 0 (later depths see the sampled d_1)
                torch.testing.assert_close(batched.draft_probs(rid)[0], reference.draft_probs(rid)[0])
        drafts = {rid: got[rid] if rid == "hot" else want[rid] for rid in want}
        if step == 2:  # a finished request gives its depth slot and pages back; a new one takes them
            scripts = [s for s in scripts if s.rid != "short"] + [Script("new", 3, [], [depth, 1, 0], 0.0, 4)]
            for spec in (reference, batched):
                spec.remove("short")
                spec.reset("new", 0, scripts[-1].tokens, [])
    assert len(graphed) >= 4, "the verify rounds run as one graphed round"
    # Its multi-row steps saw sequences of different row counts in one batch (odd ones among them, and sequences
    # with fewer rows than the step), committed and provisional rows in one step, rows straddling a page boundary.
    assert any(len(set(rows.total[:, 0].tolist())) > 1 and (rows.total[:, 0] % 2).any() for _, rows in graphed)
    assert any(rows.total[:, 0].min() < first for first, rows in graphed)
    assert any(((0 < rows.count) & (rows.count < rows.total)).any() for _, rows in graphed)
    page = batched.pools.cache.page_size
    for _, rows in graphed:
        straddling = (rows.start // page != (rows.start + rows.total - 1) // page) & (rows.total > 0)
        if straddling.any():
            break
    else:
        raise AssertionError("no round's rows straddle a page boundary")
    return returned


@pytest.fixture(params=["per request", "arrays"])
def plans(request, monkeypatch):
    """Both builders of a graphed round's plan (`_plan_lists` below `_ARRAYS_FROM` requests, `_plan_arrays`)."""
    monkeypatch.setattr(mtp, "_ARRAYS_FROM", 1 if request.param == "arrays" else 1 << 30)


def test_paged_chain_equals_the_contiguous_speculator(cpu_interpreter, drafter, plans):
    returned = compare(MTPSpeculator(drafter, 3), paged(drafter, 3), drafter, 3, exact=False)
    assert any(q is not None for q in returned), "rounds with a sampled row return their distributions"


def test_greedy_rounds_draft_the_argmax_without_distributions(cpu_interpreter, drafter):
    """Every row greedy: each round runs the greedy variant (no softmax, no `q`) and drafts what the per-request
    speculator drafts."""
    returned = compare(MTPSpeculator(drafter, 3), paged(drafter, 3), drafter, 3, exact=False, hot=0.0)
    assert returned and all(q is None for q in returned)


@pytest.mark.gpu
def test_paged_chain_with_the_fp8_head_equals_the_contiguous_speculator(cuda_device, checkpoint):
    """The FP8 draft head on its kernel (fp32 on CUDA: the 200k-row head is too slow for the CPU interpreter): the
    paged chain from its graphs drafts what the per-request speculator drafts, the same depth-0 `q`; and its
    graph replays equal the same chain run eagerly, in bf16."""
    drafter = build(checkpoint, torch.float32, "cuda", head="fp8")[1]
    assert drafter.fp8_head is not None
    compare(MTPSpeculator(drafter, 3), paged(drafter, 3), drafter, 3, exact=False)
    drafter = build(checkpoint, torch.bfloat16, "cuda", head="fp8")[1]
    compare(paged(drafter, DEPTHS, use_graphs=False), paged(drafter, DEPTHS), drafter, DEPTHS, exact=True)


def test_fewer_drafts_per_round_queue_the_deeper_depths_exactly(cpu_interpreter, drafter, plans):
    """`depth_for` of 1, 0, 3, 2 drafts: the paged speculator's deeper depths queue their rows (an 80-row prompt
    drafted at D = 1 leaves them past the 64-row lag, so the next round catches them up) and draft what the
    per-request speculator, which runs every depth every round, drafts."""
    compare(MTPSpeculator(drafter, 3), paged(drafter, 3), drafter, 3, exact=False, schedule=[1, 0, 3, 2])


@pytest.mark.gpu
def test_chain_from_its_cuda_graphs_equals_the_same_chain_eager(cuda_device, checkpoint, plans):
    """bf16 on the GPU: the graph replays give exactly what the same static-buffer chain gives eagerly."""
    drafter = build(checkpoint, torch.bfloat16, "cuda")[1]
    graphed = paged(drafter, DEPTHS)
    assert graphed.graphs.capture
    compare(paged(drafter, DEPTHS, use_graphs=False), graphed, drafter, DEPTHS, exact=True)


def test_a_request_without_a_free_depth_slot_runs_without_drafts(cpu_interpreter, drafter):
    batched = paged(drafter, 2, max_num_seqs=1)
    batched.reset("a", 0, [5, 6, 7], [])
    batched.reset("b", 0, [5, 6, 7], [])
    h = drafter.config.hidden_size
    inputs = [DraftInput(rid, 0, torch.randn(2, h), [5, 6, 7], True) for rid in ("a", "b")]
    out = batched.extend(inputs)
    assert set(out) == {"a"} and len(out["a"]) == 2
    batched.remove("a")
    batched.reset("b", 0, [5, 6, 7], [])
    assert set(batched.extend(inputs[1:])) == {"b"}


def test_depth_pages_are_taken_ahead_and_released_in_groups(drafter):
    """Rounds of 3 rows: every position below the round's end has a page of each kind, no sliding page a committed
    row's window sees is released, at most AHEAD_PAGES pages past the end are taken and 2 * AHEAD_PAGES + 1 sliding
    pages beyond the window held, and the full page bookkeeping runs in few rounds; with no page to spare the round
    still gets exactly the pages it needs."""
    page, window = 4, drafter.config.sliding_window
    spec = CacheSpec(page, 64, 64, 2, torch.float32, "cpu")
    pools = DepthPools(drafter, spec, max_model_len=128, num_depths=2)
    seq, full, rounds = DepthSequence(pools), 0, range(3, 123, 3)
    tables = seq.pages.tables
    for end in rounds:
        committed = end - 3
        before = (len(tables[True]), len(tables[False]), tables[True].count(None))
        assert seq.grow(end, committed)
        full += before != (len(tables[True]), len(tables[False]), tables[True].count(None))
        needed = -(-end // page)
        assert needed <= len(tables[False]) <= needed + AHEAD_PAGES
        assert needed <= len(tables[True]) <= needed + AHEAD_PAGES
        first_seen = max(0, committed - (window - 1)) // page
        assert None not in tables[True][first_seen:needed], "a page a committed row's window sees was released"
        live = sum(p is not None for p in tables[True])
        assert live <= needed - first_seen + 2 * AHEAD_PAGES + 1
    assert full <= len(rounds) // 2, f"{full} of {len(rounds)} rounds changed pages"

    tight = DepthPools(drafter, CacheSpec(page, 64, 3, 1, torch.float32, "cpu"), max_model_len=128, num_depths=2)
    seq = DepthSequence(tight)
    assert seq.grow(3 * page, 0)  # the whole global pool, nothing ahead
    assert len(seq.pages.tables[False]) == 3
    assert not seq.grow(3 * page + 1, 0)


@pytest.mark.gpu
def test_the_engine_speculates_through_the_paged_chain(cuda_device, checkpoint):
    """fp32 on CUDA (the whole engine on the kernels is too slow for the CPU interpreter): the trunk on the kernels
    gets the batched, graphed speculator; its greedy outputs equal the non-speculative run's."""
    from decode_service.engine.engine import Engine, EngineSettings
    from decode_service.engine.request import Request, SamplingParams

    trunk, drafter, config = build(checkpoint, torch.float32, "cuda")
    sampling = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = [[11, 12, 13], torch.randint(4, 200000, (19,), generator=torch.Generator().manual_seed(8)).tolist()]

    def outputs(depth: int) -> tuple[Engine, list[list[int]]]:
        settings = EngineSettings(
            kv_cache_bytes=1 << 23, page_size=4, max_num_seqs=2, max_num_batched_tokens=24, device="cuda",
            mtp_depth=depth,
        )  # fmt: skip
        engine = Engine(trunk, config, settings, drafter=drafter)
        outs = engine.generate([Request(f"r{i}", list(p), sampling) for i, p in enumerate(prompts)])
        return engine, [o.token_ids for o in outs]

    engine, speculative = outputs(2)
    assert isinstance(engine.speculator, PagedMTPSpeculator) and engine.speculator.graphs.capture
    assert engine.speculation.num_rounds
    assert speculative == outputs(0)[1]
