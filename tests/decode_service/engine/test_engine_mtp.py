"""MTP speculation in the engine (spec inkling-text 7): greedy outputs with D drafts per step equal D = 0, and the
trunk's KV and conv state after a speculative step equal the non-speculative run's at the same position.

Checkpoint: make-tiny with 4 MTP depths (depth 0 sliding, the rest global), fp32. Its random drafter is almost
always wrong, so two test doubles force the acceptance: an oracle that knows the target's answer (full and partial
acceptance, every accepted length 0..D) and one that is always wrong. Page size 4 and window 16: the verify runs
cross page and window boundaries.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from common.checkpoint import CheckpointFiles, load_decoder_weights, load_mtp_weights
from common.config import load_model_config
from common.errors import ConfigError
from decode_service.engine.engine import Engine, EngineSettings
from decode_service.engine.request import MultimodalItem, Request, SamplingParams
from decode_service.engine.worker.mtp import DraftInput
from decode_service.model.inkling import InklingDecoder
from decode_service.model.mtp import MTPDrafter
from inkling_kernels.fp8_head import fp8_logits_reference
from tools.make_tiny_checkpoint import make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def tiny_checkpoint(directory):
    return make_tiny_checkpoint(directory, seed=3, mtp_config={"num_nextn_predict_layers": 4})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tiny_checkpoint(tmp_path_factory.mktemp("mtp4"))
    files, config = CheckpointFiles(directory), load_model_config(directory)
    weights, _ = load_decoder_weights(files, config, dtype=torch.float32)
    trunk = InklingDecoder.from_weights(config.text, weights, torch.float32)
    mtp, _ = load_mtp_weights(files, config, dtype=torch.float32)
    return trunk, MTPDrafter.from_weights(mtp, config.mtp, trunk), config


def settings(**kw) -> EngineSettings:
    base = dict(
        kv_cache_bytes=1 << 23, page_size=4, max_num_seqs=4, max_num_batched_tokens=24, snapshot_interval_blocks=2
    )
    return EngineSettings(**(base | kw))


def prompt(n: int, seed: int, vocab: int = 200000) -> list[int]:
    return torch.randint(4, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(tiny, requests: list[Request], drafter=None, first: int = 0, **kw) -> list[list[int]]:
    """Outputs of `requests` on one engine: the first `first` run to completion, then the rest together."""
    trunk, mtp, config = tiny
    engine = Engine(trunk, config, settings(**kw), drafter=drafter if drafter is not None else mtp)
    outs = engine.generate(requests[:first]) + engine.generate(requests[first:])
    return [out.token_ids for out in outs]


def fresh(specs) -> list[Request]:
    return [Request(rid, list(p), s, mm_items=mm) for rid, p, s, mm in specs]


class Oracle:
    """Drafts the target's own greedy continuation, corrupted at a cycling index: accepted lengths 0..D all occur
    (index D: nothing corrupted, full acceptance). `wrong`: every draft wrong."""

    def __init__(self, answers: dict[str, list[int]], depth: int, wrong: bool = False, vocab: int = 200000):
        self.answers, self.num_depths, self.wrong, self.vocab = answers, depth, wrong, vocab
        self.rounds = Counter()
        self.rows: dict[str, int] = {}

    def reset(self, request_id: str, start: int, token_ids: list[int], pages: list[int | None]) -> None:
        self.rows[request_id] = start

    def remember(self, hidden: torch.Tensor, rows: list) -> None:
        pass

    def forget(self, pages: tuple[int, ...]) -> None:
        pass

    def remove(self, request_id: str) -> None:
        self.rows.pop(request_id, None)

    def draft_probs(self, request_id: str) -> None:
        return None  # deterministic drafts: verified by sampling the target row by row

    def extend(self, inputs: list[DraftInput]) -> dict[str, tuple[int, ...]]:
        out = {}
        for item in inputs:
            assert item.first_row == self.rows[item.request_id], "the runner skipped or repeated trunk rows"
            self.rows[item.request_id] += item.hidden.shape[0]
            if not item.draft:
                continue
            answer, k = self.answers[item.request_id], len(item.token_ids)
            drafts = answer[k : k + self.num_depths]
            drafts += [5] * (self.num_depths - len(drafts))
            cut = 0 if self.wrong else self.rounds[item.request_id] % (self.num_depths + 1)
            self.rounds[item.request_id] += 1
            out[item.request_id] = tuple(
                (t + 1) % self.vocab if self.wrong or i == cut else t for i, t in enumerate(drafts)
            )
        return out


SPECS = [
    ("a", prompt(5, 1), GREEDY, ()),
    ("b", prompt(23, 2), SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True), ()),
    ("c", prompt(14, 3), GREEDY, ()),
    ("d", prompt(31, 4), SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True), ()),
    ("e", prompt(9, 5), GREEDY, ()),
]


@pytest.fixture(scope="module")
def baseline(tiny):
    return run(tiny, fresh(SPECS), mtp_depth=0)


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_checkpoint_drafter_greedy_equals_no_speculation(tiny, baseline, depth):
    assert run(tiny, fresh(SPECS), mtp_depth=depth) == baseline


@pytest.mark.parametrize("depth", [1, 3, 4])
def test_oracle_drafter_every_acceptance_length(tiny, baseline, depth):
    answers = {rid: p + out for (rid, p, _, _), out in zip(SPECS, baseline, strict=True)}
    oracle = Oracle(answers, depth)
    trunk, _, config = tiny
    engine = Engine(trunk, config, settings(mtp_depth=depth), drafter=oracle)
    requests = fresh(SPECS)
    for r in requests:
        engine.add_request(r)
    lengths, final = Counter(), {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.new_token_ids and len(out.token_ids) > 1:
                lengths[len(out.new_token_ids)] += 1
            if out.finished:
                final[out.request_id] = out
    assert [r.output_token_ids for r in requests] == baseline
    assert set(range(1, depth + 2)) <= set(lengths), lengths  # accepted 0..D drafts (+ the bonus token)
    stats = engine.speculation
    assert all(stats.accepted_lengths[a] > 0 for a in range(depth + 1))
    assert sum(stats.accepted_lengths) == stats.num_rounds
    assert stats.accepted_at == [sum(stats.accepted_lengths[k + 1 :]) for k in range(depth)]
    assert sum(out.num_accepted_draft_tokens for out in final.values()) == stats.num_accepted_tokens
    assert sum(out.num_draft_tokens for out in final.values()) == stats.num_draft_tokens
    assert 1.0 < stats.mean_accepted_length < depth + 1


def test_always_wrong_drafter_emits_one_token_per_step(tiny, baseline):
    answers = {rid: p + out for (rid, p, _, _), out in zip(SPECS, baseline, strict=True)}
    trunk, _, config = tiny
    engine = Engine(trunk, config, settings(mtp_depth=2), drafter=Oracle(answers, 2, wrong=True))
    requests = fresh(SPECS)
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished:
        assert all(len(out.new_token_ids) <= 1 for out in engine.step())
    assert [r.output_token_ids for r in requests] == baseline


def trunk_state(engine: Engine, request: Request) -> list[torch.Tensor]:
    """Conv states of the request's slot and the KV of every position its layers can still read."""
    kv, seq, n = engine.kv, request.handle, request.num_computed_tokens
    out = [s[seq.slot].clone() for states in kv.conv for s in states]
    for sliding in (True, False):
        first = max(0, n - (kv.window - 1)) if sliding else 0
        pos = torch.arange(first, n)
        pages = torch.tensor([seq.tables[sliding][p // kv.page_size] for p in pos.tolist()], dtype=torch.int64)
        rows = pages * kv.page_size + pos % kv.page_size
        out += [kv.k[sliding].index_select(1, rows), kv.v[sliding].index_select(1, rows)]
    return out


def trunk_engine(model, config, depth: int, drafter=None) -> Engine:
    # max_model_len 128: two key blocks, so the global layers' decode attention splits and combines in two, not the
    # ~60 programs (mostly idle, each one costly in the interpreter) of the KV budget's 3712 positions.
    kw = dict(mtp_depth=depth, kv_cache_bytes=1 << 20, max_model_len=128)
    return Engine(model, config, settings(**kw), drafter=drafter)


def states_by_position(engine: Engine) -> tuple[dict[int, list[torch.Tensor]], list[int]]:
    request = Request("s", prompt(19, 8, 90), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    engine.add_request(request)
    seen = {}
    while engine.has_unfinished:
        engine.step()
        if not request.is_finished and request.output_token_ids:
            seen[request.num_computed_tokens] = trunk_state(engine, request)
    return seen, request.output_token_ids


def test_trunk_state_after_speculative_steps_equals_no_speculation(fake_model, model_config):
    """On the float64 fake decoder of the engine tests (its KV and four conv states per layer carry all history;
    the real trunk computes convs and norms in fp32, so a verify's rows differ from one-row steps by rounding)."""
    plain, answer = states_by_position(trunk_engine(fake_model, model_config, 0))
    oracle = Oracle({"s": prompt(19, 8, 90) + answer}, 3, vocab=90)
    spec, tokens = states_by_position(trunk_engine(fake_model, model_config, 3, oracle))
    assert tokens == answer
    assert len(spec) < len(plain) - 5  # the oracle made steps advance several positions
    for position, state in spec.items():
        for got, want in zip(state, plain[position], strict=True):
            torch.testing.assert_close(got, want)


def test_stop_token_inside_an_accepted_run_cuts_exactly_there(tiny, baseline):
    rid, p, _, _ = SPECS[1]
    stop = baseline[1][6]
    cut = baseline[1][: baseline[1].index(stop) + 1]
    sampling = SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True, stop_token_ids=(stop,))
    trunk, _, config = tiny
    oracle = Oracle({rid: p + baseline[1]}, 4)
    oracle.rounds[rid] = 4  # full acceptance from the first round
    engine = Engine(trunk, config, settings(mtp_depth=4), drafter=oracle)
    out = engine.generate([Request(rid, p, sampling)])[0]
    assert out.token_ids == cut and out.finish_reason == "stop"


def test_prefix_hits_preemption_and_media_equal_no_speculation(tiny):
    trunk, _, config = tiny
    hidden = config.text.hidden_size
    g = torch.Generator().manual_seed(5)
    shared = prompt(26, 11)
    image = [config.image_token_id] * 7
    audio = [config.audio_token_id] * 5
    mm_prompt = prompt(3, 12) + image + prompt(4, 13) + audio + prompt(6, 14)
    items = (
        MultimodalItem(b"\x07" * 32, 3, torch.randn(7, hidden, generator=g)),
        MultimodalItem(b"\x08" * 32, 14, torch.randn(5, hidden, generator=g)),
    )
    specs = [
        ("p0", shared + [7, 8], GREEDY, ()),
        ("p1", shared + [9, 10, 11], GREEDY, ()),
        ("mm", mm_prompt, GREEDY, items),
        ("q", prompt(33, 15), GREEDY, ()),
        ("r", prompt(21, 16), GREEDY, ()),
    ]
    # 17 global pages of 4 tokens: the running sequences cannot all grow, so some are preempted.
    tight = dict(kv_cache_bytes=150_000, max_num_batched_tokens=12)
    want = run(tiny, fresh(specs), first=1, mtp_depth=0, **tight)
    # D = 4 here; D = 1, 2, 4 without preemption in test_checkpoint_drafter_greedy_equals_no_speculation.
    requests = fresh(specs)
    assert run(tiny, requests, first=1, mtp_depth=4, **tight) == want
    assert requests[1].num_cached_tokens > 0
    assert sum(r.num_preemptions for r in requests) > 0


def test_per_request_opt_out_and_bad_depth(tiny, baseline):
    trunk, mtp, config = tiny
    rid, p, s, _ = SPECS[0]
    off = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, speculative=False)
    oracle = Oracle({rid: p + baseline[0]}, 2)
    engine = Engine(trunk, config, settings(mtp_depth=2), drafter=oracle)
    out = engine.generate([Request(rid, p, off)])[0]
    assert out.token_ids == baseline[0] and not oracle.rounds
    with pytest.raises(ConfigError, match="mtp_depth=2"):
        Engine(trunk, config, settings(mtp_depth=2))
    with pytest.raises(ValueError, match="mtp_depth"):
        Engine(trunk, config, settings(mtp_depth=5), drafter=mtp)


def test_mtp_depth_flag_builds_the_checkpoint_drafter(tmp_path):
    from common.settings import DecodeEngineSettings, decode_settings
    from decode_service.engine.build import build_engine
    from tools.cli import build_parser

    make_tiny_checkpoint(tmp_path, seed=4)
    args = build_parser().parse_args(
        ["decode", "--checkpoint", str(tmp_path), "--mtp-depth", "2", "--dtype", "float32"]
    )
    engine_settings = decode_settings(args).engine
    assert engine_settings.mtp_depth == 2
    engine = build_engine(tmp_path, dataclasses.replace(engine_settings, kv_cache_bytes=1 << 23))
    assert engine.speculator.num_depths == 2 and engine.speculator.drafter.num_depths == 2
    with pytest.raises(ConfigError, match="--mtp-depth"):
        DecodeEngineSettings(mtp_depth=-1)


class SampledDrafter:
    """Drafts sampled from one fixed distribution `q` (whatever the rows), reported for rejection sampling."""

    def __init__(self, q: torch.Tensor, depth: int):
        self.q, self.num_depths, self.probs = q, depth, {}
        self.verified = 0

    def reset(self, request_id: str, start: int, token_ids: list[int], pages: list[int | None]) -> None:
        pass

    def remember(self, hidden: torch.Tensor, rows: list) -> None:
        pass

    def forget(self, pages: tuple[int, ...]) -> None:
        pass

    def remove(self, request_id: str) -> None:
        self.probs.pop(request_id, None)

    def draft_probs(self, request_id: str) -> torch.Tensor | None:
        return self.probs.get(request_id)

    def extend(self, inputs: list[DraftInput]) -> dict[str, tuple[int, ...]]:
        out = {}
        for item in inputs:
            if item.draft:
                assert item.temperature > 0 and item.generator is not None
                drafts = torch.multinomial(self.q, self.num_depths, replacement=True, generator=item.generator)
                self.probs[item.request_id] = self.q.expand(self.num_depths, -1)
                out[item.request_id] = tuple(drafts.tolist())
        return out


@torch.inference_mode()
def target_joint(model, config, prompt_ids: list[int], sampling: SamplingParams) -> dict[tuple[int, int], float]:
    """P(t1, t2) of the target under `sampling` (top-k keeps the support small), from the contiguous reference."""
    from decode_service.engine.worker.sampler import filtered_probs
    from decode_service.model.batch import ForwardBatch, SequenceSlice
    from decode_service.model.state import SequenceState

    def probs(tokens: list[int]) -> torch.Tensor:
        state = SequenceState.fresh(config.text, conv_dtype=model.dtype)
        hidden = model.forward(ForwardBatch(torch.tensor(tokens), [SequenceSlice(0, len(tokens), state.layers)]))
        p = filtered_probs(model.logits(hidden[-1:]).float(), [sampling])[0]
        return p / p.sum()

    first, joint = probs(prompt_ids), {}
    for t1 in first.nonzero().flatten().tolist():
        second = probs(prompt_ids + [t1])
        for t2 in second.nonzero().flatten().tolist():
            joint[t1, t2] = float(first[t1] * second[t2])
    return joint


def test_rejection_sampling_in_the_engine_keeps_the_target_distribution(fake_model, model_config):
    """Temperature 1, top-k 3: the first two tokens of 800 seeded requests (the second one verified against a
    draft from a fixed `q`) follow the target's joint distribution (chi-square), and drafts are accepted."""
    from scipy.stats import chisquare

    p = prompt(6, 21, 90)
    sampling = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    joint = target_joint(fake_model, model_config, p, sampling)
    cells = sorted(joint)
    q = torch.softmax(torch.randn(90, generator=torch.Generator().manual_seed(2)), -1)
    q[[t2 for _, t2 in cells]] += 0.3  # the drafts often hit the support of the second token
    q /= q.sum()
    engine = Engine(
        fake_model,
        model_config,
        settings(mtp_depth=1, max_num_seqs=64, max_num_batched_tokens=512, enable_prefix_cache=False),
        drafter=SampledDrafter(q, 1),
    )
    n = 800
    for i in range(n):
        engine.add_request(Request(f"s{i}", list(p), dataclasses.replace(sampling, seed=i)))
    pairs, accepted = Counter(), 0
    while engine.has_unfinished:
        for out in engine.step():
            accepted += len(out.new_token_ids) == 2  # the verify of [t1, d1] kept d1
            if out.finished:
                pairs[tuple(out.token_ids[:2])] += 1
    assert set(pairs) <= set(cells) and accepted > n // 10
    total = sum(joint.values())
    assert chisquare([pairs[c] for c in cells], [n * joint[c] / total for c in cells]).pvalue > 1e-3


def test_checkpoint_drafter_samples_its_drafts_above_temperature_zero(tiny):
    """Temperature > 0: the depths' drafts are sampled and kept as `q` for rejection sampling; seeded requests
    repeat exactly run to run."""
    sampling = SamplingParams(temperature=0.7, max_tokens=8, ignore_eos=True, seed=5)
    specs = [("t0", prompt(7, 31), sampling, ()), ("t1", prompt(18, 32), dataclasses.replace(sampling, seed=6), ())]
    trunk, mtp, config = tiny
    engine = Engine(trunk, config, settings(mtp_depth=2), drafter=mtp)
    seen = []
    requests = fresh(specs)
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished:
        engine.step()
        seen += [engine.speculator.draft_probs(r.request_id) for r in requests if not r.is_finished]
    probs = [q for q in seen if q is not None]
    assert probs and all(q.shape == (2, config.text.unpadded_vocab_size) for q in probs)
    torch.testing.assert_close(probs[0].sum(-1), torch.ones(2))
    again = run(tiny, fresh(specs), mtp_depth=2)
    assert [r.output_token_ids for r in requests] == again and all(len(t) == 8 for t in again)


@pytest.fixture(scope="module")
def fp8_drafter(tmp_path_factory, tiny) -> MTPDrafter:
    """The checkpoint's drafter (the same files again) on the same trunk, drafting through the FP8 copy of the
    lm_head."""
    trunk, _, config = tiny
    directory = tiny_checkpoint(tmp_path_factory.mktemp("mtp4_fp8"))
    mtp, _ = load_mtp_weights(CheckpointFiles(directory), config, dtype=torch.float32)
    return MTPDrafter.from_weights(mtp, config.mtp, trunk, head="fp8")


@pytest.mark.parametrize("depth", [2, 4])
def test_fp8_draft_head_greedy_equals_no_speculation(tiny, baseline, fp8_drafter, depth):
    assert run(tiny, fresh(SPECS), drafter=fp8_drafter, mtp_depth=depth) == baseline


def test_fp8_draft_head_q_is_the_distribution_of_its_logits(tiny, fp8_drafter, monkeypatch):
    """Temperature > 0 with the FP8 head: every draft logit row the speculator computes is the FP8 copy's (not the
    bf16 head's), and every `q` kept for rejection sampling is softmax(those logits / T)."""
    trunk, bf16_drafter, config = tiny
    temperature = 0.7
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (hidden, logits) of every draft-head call
    logits = fp8_drafter.logits

    def spy(hidden: torch.Tensor) -> torch.Tensor:
        out = logits(hidden)
        seen.append((hidden.clone(), out.clone()))
        return out

    monkeypatch.setattr(fp8_drafter, "logits", spy)
    sampling = SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True, seed=5)
    requests = fresh([("f0", prompt(7, 41), sampling, ()), ("f1", prompt(12, 42), sampling, ())])
    engine = Engine(trunk, config, settings(mtp_depth=2), drafter=fp8_drafter)
    qs = []
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished:
        engine.step()
        qs += [q for r in requests if (q := engine.speculator.draft_probs(r.request_id)) is not None]
    assert seen and qs
    w8, scale = fp8_drafter.fp8_head
    mup = config.text.mup_multiplier
    for hidden, out in seen:
        assert torch.equal(out, fp8_logits_reference(hidden, w8, scale, divisor=mup))
        bf16 = bf16_drafter.logits(hidden)
        assert (out - bf16).abs().max() > 1e-4 * bf16.abs().max()
    rows = torch.cat([out for _, out in seen])  # [N, V]
    for q in qs:
        for row in q:
            want = torch.softmax(rows / temperature, -1)
            assert torch.isclose(want, row[None], rtol=1e-6, atol=1e-9).all(-1).any(), "q of no FP8 logit row"


def test_structured_output_matcher_sees_only_emitted_tokens(tiny):
    """A regex constraint with the oracle's partly wrong drafts: the output equals the non-speculative one and the
    matcher accepted exactly the emitted tokens (it is advanced per emitted token, never by a rejected draft)."""
    from decode_service.chat import CONTENT_TEXT, END_MESSAGE, MESSAGE_USER, encode_text
    from decode_service.structured.compiler import ConstraintCompiler
    from decode_service.structured.constraint import OutputConstraint
    from decode_service.structured.matcher import ConstraintMatcher

    trunk, _, config = tiny
    p = [MESSAGE_USER, CONTENT_TEXT, *encode_text("Say a word"), END_MESSAGE]
    sampling = SamplingParams(temperature=0.0, max_tokens=14)
    compiler = ConstraintCompiler(config.text.unpadded_vocab_size, config.eos_token_ids)
    try:
        compiled = compiler.compile_sync(OutputConstraint("regex", "[a-z]{4,30}"), ())

        def request(rid: str) -> Request:
            matcher = ConstraintMatcher(compiled, p, config.eos_token_ids, sampling.stop_token_ids)
            return Request(rid, list(p), sampling, constraint=matcher)

        plain = Engine(trunk, config, settings()).generate([request("c")])[0]
        oracle = Oracle({"c": p + plain.token_ids}, 3)
        spec_request = request("c")
        spec = Engine(trunk, config, settings(mtp_depth=3), drafter=oracle).generate([spec_request])[0]
    finally:
        compiler.close()
    assert spec.token_ids == plain.token_ids and spec.finish_reason == plain.finish_reason
    assert oracle.rounds["c"] > 1
    assert spec_request.constraint.num_accepted == len(spec.token_ids)


def test_logprobs_of_accepted_runs_and_abort(fake_model, model_config):
    p = prompt(11, 41, 90)
    sampling = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    reference = Request("l", list(p), sampling)
    plain = Engine(fake_model, model_config, settings()).generate([reference])[0]
    oracle = Oracle({"l": p + plain.token_ids}, 3, vocab=90)
    engine = Engine(fake_model, model_config, settings(mtp_depth=3), drafter=oracle)
    request = Request("l", list(p), sampling)
    spec = engine.generate([request])[0]
    assert spec.token_ids == plain.token_ids and len(request.output_logprobs) == 16
    for got, want in zip(request.output_logprobs, reference.output_logprobs, strict=True):
        assert got.logprob == pytest.approx(want.logprob)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]

    oracle.rounds.clear()
    oracle.rounds["x"] = 3  # full acceptance: several tokens per step
    oracle.answers["x"] = p + plain.token_ids
    engine.add_request(Request("x", list(p), sampling))
    emitted = []
    for _ in range(3):
        emitted += [t for out in engine.step() for t in out.new_token_ids]
    engine.abort("x")
    final = engine.step()
    assert [out.finish_reason for out in final] == ["abort"] and not engine.has_unfinished
    assert final[0].token_ids == emitted == plain.token_ids[: len(emitted)] and len(emitted) > 3


@torch.inference_mode()
def test_logprobs_of_accepted_sampled_drafts_are_the_targets(fake_model, model_config):
    """Above temperature 0 (rejection sampling) every emitted token's logprob and top-2 are what a
    non-speculative run reports at its position: the log-softmax of the trunk's row given the tokens before it."""
    from decode_service.model.batch import ForwardBatch, SequenceSlice
    from decode_service.model.state import SequenceState

    p = prompt(6, 21, 90)
    sampling = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, logprobs=2, seed=1)
    engine = Engine(fake_model, model_config, settings(mtp_depth=2), drafter=SampledDrafter(torch.ones(90) / 90, 2))
    request = Request("l", list(p), sampling)
    out = engine.generate([request])[0]
    assert out.num_accepted_draft_tokens > 0 and len(request.output_logprobs) == 12
    tokens = p + out.token_ids
    state = SequenceState.fresh(model_config.text, conv_dtype=fake_model.dtype)
    hidden = fake_model.forward(ForwardBatch(torch.tensor(tokens), [SequenceSlice(0, len(tokens), state.layers)]))
    target = torch.log_softmax(fake_model.logits(hidden[len(p) - 1 : -1]).float(), -1)  # [12, V]
    for k, (token, got) in enumerate(zip(out.token_ids, request.output_logprobs, strict=True)):
        assert got.logprob == pytest.approx(float(target[k, token]), abs=1e-5)
        assert [t for t, _ in got.top] == target[k].topk(2).indices.tolist()


def test_prefix_hit_recomputes_the_depths_from_the_cached_rows(tiny):
    """A request that hits the prefix cache drafts what it drafts without the cache: its depths are recomputed
    over the cached prefix from the trunk rows kept with the pages."""
    trunk, mtp, config = tiny
    shared = prompt(26, 51)
    first, second = Request("a", shared + [7, 8], GREEDY), Request("b", shared + [9, 10, 11], GREEDY)

    def drafts_of(engine: Engine, rid: str) -> list[tuple[int, ...]]:
        seen, extend, reset = [], engine.speculator.extend, engine.speculator.reset

        def recording(inputs):
            out = extend(inputs)
            seen.extend(out[i.request_id] for i in inputs if i.request_id == rid and i.draft)
            return out

        def checked(request_id, start, token_ids, pages):
            reset(request_id, start, token_ids, pages)
            if request_id == rid and start:
                assert engine.speculator.states[rid].committed[0] == start  # rows 0..start-1 recomputed
                layer = engine.speculator.states[rid].state.layers[1]  # a global depth keeps every row
                assert layer.k is not None and layer.first_position == 0 and layer.k.shape[0] == start

        engine.speculator.extend, engine.speculator.reset = recording, checked
        return seen

    cached = Engine(trunk, config, settings(mtp_depth=2), drafter=mtp)
    cached.generate([first])
    recorded = drafts_of(cached, "b")
    out = cached.generate([second])[0]
    assert second.num_cached_tokens == 24
    alone = Engine(trunk, config, settings(mtp_depth=2, enable_prefix_cache=False), drafter=mtp)
    want = drafts_of(alone, "b")
    assert alone.generate([Request("b", shared + [9, 10, 11], GREEDY)])[0].token_ids == out.token_ids
    assert recorded == want and len(want) > 3


def test_context_limits_inside_accepted_runs(fake_model, model_config):
    """Drafts stop at the context limit, whether it is max_model_len or the KV capacity of one sequence: the
    output ends with LENGTH exactly where D = 0 ends, without preemption."""
    p = prompt(13, 61, 90)
    sampling = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for kw in (dict(max_model_len=27), dict(kv_cache_bytes=_one_sequence_budget(model_config, 44))):
        plain_engine = Engine(fake_model, model_config, settings(**kw))
        plain = plain_engine.generate([Request("m", list(p), sampling)])[0]
        oracle = Oracle({"m": p + plain.token_ids}, 4, vocab=90)
        oracle.rounds["m"] = 4  # full acceptance
        engine = Engine(fake_model, model_config, settings(mtp_depth=4, **kw), drafter=oracle)
        request = Request("m", list(p), sampling)
        out = engine.generate([request])[0]
        assert out.token_ids == plain.token_ids and out.finish_reason == plain.finish_reason
        assert request.num_preemptions == 0 and engine.speculation.num_rounds > 0


def _one_sequence_budget(config, tokens: int) -> int:
    """kv_cache_bytes whose global pool holds `tokens` positions (page size 4) for the tiny fp64 fake config."""
    from decode_service.engine.worker.kv_cache import CacheSpec

    for budget in range(1 << 14, 1 << 22, 256):
        try:
            spec = CacheSpec.from_budget(
                config.text, budget, page_size=4, max_num_seqs=4, max_num_batched_tokens=24, dtype=torch.float64
            )
        except ConfigError:
            continue
        if spec.num_global_pages * 4 >= tokens:
            return budget
    raise AssertionError("no budget found")


def test_verify_steps_through_the_decode_graphs_equal_no_speculation(cpu_interpreter, kernel_model, kernel_config):
    """The batched paged path (kernels in the interpreter, the decode graphs' static-buffer steps run eagerly):
    with the oracle's drafts (every accepted length 0..3) each verify step is one `DecodeGraphs.verify`, its
    tokens the graphs' argmax, and its commit, never the packed path's replay; tokens, and the trunk's KV and conv
    state at every position the speculative run reaches, equal the non-speculative run on the same path."""
    model = kernel_model.with_ops("fast")
    plain, answer = states_by_position(trunk_engine(model, kernel_config, 0))
    oracle = Oracle({"s": prompt(19, 8, 90) + answer}, 3, vocab=90)
    engine = trunk_engine(model, kernel_config, 3, oracle)
    runner, widths, packed, argmax = engine.runner, [], [], []
    verify, forward_packed = runner.decode_graphs.verify, runner._forward_packed
    runner.decode_graphs.verify = lambda ids, views: widths.append(max(map(len, ids))) or verify(ids, views)
    runner._forward_packed = lambda output: packed.extend(c.num_drafts for c in output.chunks) or forward_packed(output)
    greedy_samples = runner._greedy_samples
    runner._greedy_samples = lambda chunks, hidden, width: argmax.append(width) or greedy_samples(chunks, hidden, width)
    spec, tokens = states_by_position(engine)
    assert tokens == answer
    assert len(widths) > 3 and max(widths) == 4
    assert sum(w > 1 for w in argmax) == len(widths)  # every verify step: the tokens are the graphs' argmax
    assert packed and not any(packed)  # only the prompt went through the packed path
    assert len(spec) < len(plain) - 5  # the oracle made steps advance several positions
    for position, state in spec.items():
        for got, want in zip(state, plain[position], strict=True):
            torch.testing.assert_close(got, want)


@pytest.mark.gpu
def test_verify_graphs_on_cuda_equal_no_speculation(cuda_device, kernel_model, kernel_config):
    """On CUDA with the verify and commit graphs captured: the oracle's speculative greedy tokens equal D = 0's."""
    model = kernel_model.to("cuda").with_ops("auto")
    try:
        specs = [(f"g{i}", prompt(n, 70 + i, 90), GREEDY, ()) for i, n in enumerate((5, 14, 23))]
        kw = dict(device="cuda", max_num_seqs=4)
        plain = [o.token_ids for o in Engine(model, kernel_config, settings(**kw)).generate(fresh(specs))]
        answers = {rid: p + out for (rid, p, _, _), out in zip(specs, plain, strict=True)}
        oracle = Oracle(answers, 3, vocab=90)
        engine = Engine(model, kernel_config, settings(mtp_depth=3, **kw), drafter=oracle)
        assert engine.runner.decode_graphs.capture
        assert [o.token_ids for o in engine.generate(fresh(specs))] == plain
        assert engine.speculation.num_accepted_tokens > 0
    finally:
        kernel_model.to("cpu")
