"""Constrained generation through the engine on the tiny checkpoint (random weights, the real vocabulary):
whatever a random model prefers, the output is one complete block that matches, and it stops on its own."""

from __future__ import annotations

import json
import re

import pytest
import torch

from decode_service.chat import (
    CONTENT_INVOKE_TOOL_JSON,
    CONTENT_TEXT,
    END_MESSAGE,
    MESSAGE_MODEL,
    MESSAGE_USER,
    MODEL_END_SAMPLING,
    ToolSpec,
    encode_text,
)
from decode_service.engine.request import Request, SamplingParams
from decode_service.engine.worker.runner import WorkerRequest
from decode_service.engine.worker.sampler import Sampler
from decode_service.output_parser import OutputParser
from decode_service.structured.constraint import ForcedToolCall, OutputConstraint
from decode_service.structured.matcher import ConstraintMatcher
from decode_service.structured.sampling import GrammarMasks

PROMPT = [MESSAGE_USER, CONTENT_TEXT, *encode_text("Give me JSON"), END_MESSAGE]
MAX_TOKENS = 160

SCHEMAS = {
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 6},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                },
                "required": ["name", "age"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "array_bounds": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 4}},
        "required": ["tags"],
    },
    "integer_range": {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": -5, "maximum": 5},
            "m": {"type": "integer", "minimum": 100, "maximum": 99999},
        },
        "required": ["n", "m"],
    },
    "optional": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 9},
            "note": {"type": "string", "maxLength": 4},
            "flag": {"type": "boolean"},
        },
        "required": ["id"],
    },
    "any_of": {
        "type": "object",
        "properties": {
            "value": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 50},
                    {"type": "string", "enum": ["none", "many"]},
                    {"type": "null"},
                ]
            }
        },
        "required": ["value"],
    },
}

TOOLS = (
    ToolSpec(
        "get_weather",
        "Weather for a city",
        {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    ),
    ToolSpec(
        "add",
        "Add numbers",
        {
            "type": "object",
            "properties": {
                "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}
            },
            "required": ["xs"],
        },
    ),
)


def constrained(compiler, engine, rid, constraint, sampling=None, tools=(), prompt=PROMPT) -> Request:
    sampling = sampling or SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    compiled = compiler.compile_sync(constraint, tools)
    matcher = ConstraintMatcher(compiled, prompt, engine.config.eos_token_ids, sampling.stop_token_ids)
    return Request(rid, list(prompt), sampling, constraint=matcher)


def validate(document, schema) -> None:
    import jsonschema  # a dev dependency the GPU hosts lack: only the CPU tests validate

    jsonschema.validate(document, schema)


def mask_logits(logits, requests):
    """A masked copy of `logits` (one row per request)."""
    masked = logits.clone()
    GrammarMasks(len(requests)).apply(masked, requests)
    return masked


def parse(token_ids):
    parser = OutputParser()
    deltas = [d for t in token_ids for d in parser.feed(t)]
    deltas += parser.finish("stop")
    content = "".join(d.text for d in deltas if d.channel == "content")
    calls = [d.tool_call for d in deltas if d.tool_call is not None]
    return content, calls, parser.finish_reason


def test_json_schemas_give_valid_json_that_stops(compiler, engine):
    requests = [
        constrained(compiler, engine, f"schema-{name}", OutputConstraint("json_schema", json.dumps(schema)))
        for name, schema in SCHEMAS.items()
    ]
    masks = engine.runner.sampler.masks
    before = masks.masked_rows
    outs = engine.generate(requests)
    assert masks.masked_rows - before == sum(len(o.token_ids) for o in outs)  # every output token was masked
    for out in outs:
        name = out.request_id.removeprefix("schema-")
        assert out.finish_reason == "stop", (name, out.token_ids)
        assert len(out.token_ids) < MAX_TOKENS // 2
        assert out.token_ids[:2] == [MESSAGE_MODEL, CONTENT_TEXT] and out.token_ids[-2:] == [
            END_MESSAGE,
            MODEL_END_SAMPLING,
        ]
        content, calls, _ = parse(out.token_ids)
        assert not calls
        validate(json.loads(content), SCHEMAS[name])
        assert content == json.dumps(
            json.loads(content), separators=(",", ":"), ensure_ascii=False
        )  # compact by default


def test_json_object_is_an_object_or_says_length(compiler, engine):
    """Any-JSON has no bound a random model must meet; what it writes is still an object as far as it goes."""
    request = constrained(compiler, engine, "object", OutputConstraint("json_object"), SamplingParams(max_tokens=24))
    out = engine.generate([request])[0]
    content, _, _ = parse(out.token_ids)
    assert content.startswith("{")
    if out.finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:
        assert out.finish_reason == "length" and not request.constraint.is_terminated


def allowed_after(compiler, engine, constraint, text):
    """Token ids the matcher allows after the block opener and `text`."""
    prompt = [*PROMPT, MESSAGE_MODEL]
    request = constrained(compiler, engine, "probe", constraint, prompt=prompt)
    for token in [CONTENT_TEXT, *encode_text(text)]:
        request.constraint.accept(token)
    logits = torch.zeros(1, engine.config.text.unpadded_vocab_size)
    return set(torch.isfinite(mask_logits(logits, [request])[0]).nonzero().flatten().tolist())


def test_whitespace_is_compact_unless_flexible(compiler, engine):
    schema = json.dumps(SCHEMAS["enum"])
    space, newline = encode_text(" ")[0], encode_text("\n")[0]
    compact = allowed_after(compiler, engine, OutputConstraint("json_schema", schema), '{"color":')
    flexible = allowed_after(
        compiler, engine, OutputConstraint("json_schema", schema, flexible_whitespace=True), '{"color":'
    )
    assert space not in compact and newline not in compact
    assert {space, newline} <= flexible
    assert encode_text('"red"')[0] in compact


@pytest.mark.parametrize("pattern", [r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)", r"(yes|no|maybe)", r"\d{3}-\d{4}"])
def test_regex_outputs_fully_match(compiler, engine, pattern):
    out = engine.generate([constrained(compiler, engine, "regex", OutputConstraint("regex", pattern))])[0]
    assert out.finish_reason == "stop"
    content, _, _ = parse(out.token_ids)
    assert re.fullmatch(pattern, content), content


def test_ebnf_and_lark_grammars(compiler, engine):
    ebnf = 'root ::= "(" item ("," item){0,2} ")"\nitem ::= [0-9] | "x"'
    lark = 'start: GREETING " " NAME\nGREETING: "hi" | "hello"\nNAME: /[A-Z][a-z]{1,4}/'
    outs = engine.generate(
        [
            constrained(compiler, engine, "ebnf", OutputConstraint("grammar", ebnf)),
            constrained(compiler, engine, "lark", OutputConstraint("lark", lark)),
        ]
    )
    assert [o.finish_reason for o in outs] == ["stop", "stop"]
    assert re.fullmatch(r"\(([0-9]|x)(,([0-9]|x)){0,2}\)", parse(outs[0].token_ids)[0])
    assert re.fullmatch(r"(hi|hello) [A-Z][a-z]{1,4}", parse(outs[1].token_ids)[0])


@pytest.mark.parametrize("function", [None, "get_weather", "add"])
def test_forced_tool_calls_parse_with_schema_valid_arguments(compiler, engine, function):
    sampling = SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_TOKENS)
    out = engine.generate([constrained(compiler, engine, "tool", ForcedToolCall(function), sampling, TOOLS)])[0]
    assert out.finish_reason == "stop"
    _, calls, reason = parse(out.token_ids)
    assert reason == "tool_calls" and calls
    assert len(calls) == 1 or function is None  # "required": one or more calls
    for call in calls:
        assert function is None or call.name == function
        schema = {t.name: t.parameters for t in TOOLS}[call.name]
        validate(json.loads(call.arguments), schema)


def test_seeded_sampling_is_constrained_and_reproducible(compiler, engine):
    constraint = OutputConstraint("json_schema", json.dumps(SCHEMAS["nested"]))

    def run(seed, rid):
        sampling = SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=MAX_TOKENS)
        return constrained(compiler, engine, rid, constraint, sampling)

    outs = engine.generate([run(1, "s1"), run(1, "s1-again"), run(2, "s2")])
    assert outs[0].token_ids == outs[1].token_ids
    for out in outs:
        assert out.finish_reason == "stop"
        validate(json.loads(parse(out.token_ids)[0]), SCHEMAS["nested"])


def test_unmet_constraint_finishes_with_length(compiler, engine):
    sampling = SamplingParams(temperature=0.0, max_tokens=4)
    request = constrained(
        compiler, engine, "short", OutputConstraint("json_schema", json.dumps(SCHEMAS["nested"])), sampling
    )
    out = engine.generate([request])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert not request.constraint.is_terminated


def test_prompt_that_opens_the_model_message(compiler, engine):
    prompt = [*PROMPT, MESSAGE_MODEL]
    request = constrained(compiler, engine, "open", OutputConstraint("regex", "(yes|no)"), prompt=prompt)
    out = engine.generate([request])[0]
    assert out.finish_reason == "stop" and out.token_ids[0] == CONTENT_TEXT
    assert parse([MESSAGE_MODEL, *out.token_ids])[0] in ("yes", "no")


def test_stop_token_ids_are_allowed_once_the_grammar_is_complete(compiler, engine):
    stop_id = encode_text("!")[0]
    sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=(stop_id,), ignore_eos=True)
    request = constrained(compiler, engine, "stop-id", OutputConstraint("regex", "(yes|no)"), sampling)
    out = engine.generate([request])[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in (stop_id, MODEL_END_SAMPLING) and request.constraint.is_terminated


def test_mask_keeps_unconstrained_rows(compiler, engine):
    a = constrained(compiler, engine, "a", OutputConstraint("regex", "(yes|no)"))
    b = Request("b", list(PROMPT))
    logits = torch.randn(2, engine.config.text.unpadded_vocab_size)
    masked = logits.clone()
    masks = GrammarMasks(2)
    assert masks.apply(masked, [a, b])
    assert torch.equal(masked[1], logits[1])
    allowed = torch.isfinite(masked[0]).nonzero().flatten().tolist()
    assert allowed == [MESSAGE_MODEL]
    assert not masks.apply(masked, [b, b])


def test_matchers_survive_preemption(compiler, checkpoint):
    """A preempted request is recomputed from its prompt and output; its matcher keeps its state meanwhile."""
    from common.settings import DecodeEngineSettings
    from decode_service.engine.build import build_engine

    settings = DecodeEngineSettings(
        dtype="float32", kv_cache_bytes=256 << 10, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_cache=False
    )
    small = build_engine(checkpoint, settings)
    names = ["nested", "any_of", "array_bounds", "optional"]
    schemas = [OutputConstraint("json_schema", json.dumps(SCHEMAS[n])) for n in names]
    prompt = [MESSAGE_USER, CONTENT_TEXT, *encode_text(" Give me some JSON, please." * 6), END_MESSAGE]
    requests = [constrained(compiler, small, f"p-{n}", c, prompt=prompt) for n, c in zip(names, schemas, strict=True)]
    outs = small.generate(requests)
    assert sum(r.num_preemptions for r in requests) > 0
    for name, out in zip(names, outs, strict=True):
        assert out.finish_reason == "stop"
        validate(json.loads(parse(out.token_ids)[0]), SCHEMAS[name])


@pytest.mark.parametrize(
    "function,after_call", [("add", {MODEL_END_SAMPLING}), (None, {MODEL_END_SAMPLING, MESSAGE_MODEL})]
)
def test_required_allows_more_calls_named_exactly_one(compiler, engine, function, after_call):
    request = constrained(compiler, engine, "calls", ForcedToolCall(function), tools=TOOLS)
    call = [
        MESSAGE_MODEL,
        *encode_text("add"),
        CONTENT_INVOKE_TOOL_JSON,
        *encode_text('{"name":"add","args":{"xs":[1]}}'),
    ]
    for token in [*call, END_MESSAGE]:
        request.constraint.accept(token)
    logits = torch.zeros(1, engine.config.text.unpadded_vocab_size)
    assert set(torch.isfinite(mask_logits(logits, [request])[0]).nonzero().flatten().tolist()) == after_call


def mixed_batch(compiler, engine):
    """Six constrained rows (two schemas; greedy, and temperature > 0 with seeds) between three plain ones."""
    schemas = [OutputConstraint("json_schema", json.dumps(SCHEMAS[n])) for n in ("nested", "array_bounds")]
    requests = []
    for i in range(9):
        sampling = SamplingParams(temperature=0.0 if i % 3 == 1 else 0.9, seed=i, top_p=0.95)
        if i % 3 == 2:
            requests.append(WorkerRequest(f"plain-{i}", list(PROMPT), sampling))
            continue
        compiled = compiler.compile_sync(schemas[i % 2])
        matcher = ConstraintMatcher(compiled, PROMPT, engine.config.eos_token_ids)
        requests.append(WorkerRequest(f"c-{i}", list(PROMPT), sampling, constraint=matcher))
    return requests


def sample_steps(sampler, requests, vocab, device, steps=6):
    """Decode steps in the runner's order; each step also samples a second row for the first three requests
    after their first token (a verify chunk's later row: its mask depends on that token). Every chosen token is
    checked against a fresh CPU mask of its matcher's state at that moment (greedy rows: the masked argmax).
    -> the tokens, and how many constrained rows the first and the second calls masked."""
    gen = torch.Generator().manual_seed(0)
    tokens, counts = [], [0, 0]
    for _ in range(steps):
        logits = (torch.randn(len(requests) + 3, vocab, generator=gen) * 4).to(device)  # [N + 3, V]
        calls = [(requests, logits[: len(requests)]), (requests[:3], logits[len(requests) :])]
        for k, (batch, rows) in enumerate(calls):
            counts[k] += sum(r.constraint is not None for r in batch)
            expected = mask_logits(rows.cpu(), batch)
            results = sampler.sample(rows, batch)
            tokens.append([r.token_id for r in results])
            for request, result, row in zip(batch, results, expected, strict=True):
                assert torch.isfinite(row[result.token_id]), (request.request_id, result.token_id)
                if request.sampling.greedy:
                    assert result.token_id == int(row.argmax()), request.request_id
                request.output_token_ids.append(result.token_id)
                if result.constraint_finished:
                    request.constraint = None  # done: the row samples unconstrained from now on
    return tokens, counts


def test_masks_filled_at_sampling_follow_each_rows_matcher(compiler, engine):
    check_masked_steps(compiler, engine, "cpu")


@pytest.mark.gpu
def test_masks_filled_at_sampling_follow_each_rows_matcher_gpu(compiler, engine, cuda_device):
    """Pinned buffers, device copies and the Triton kernel (sampled rows draw from CUDA generators: other tokens than
    on the CPU, each checked against the CPU mask of its state)."""
    check_masked_steps(compiler, engine, cuda_device)


def check_masked_steps(compiler, engine, device):
    vocab = engine.config.text.unpadded_vocab_size
    sampler = Sampler(max_rows=9, device=device)
    tokens, (first, later) = sample_steps(sampler, mixed_batch(compiler, engine), vocab, device)
    assert len({t for step in tokens for t in step}) > 20  # really sampling
    assert first > 0 and later > 0
    assert sampler.masks.masked_rows == first + later
    return tokens


def test_the_mask_buffers_are_allocated_once(compiler, engine):
    vocab = engine.config.text.unpadded_vocab_size
    sampler = Sampler(max_rows=9)
    requests = mixed_batch(compiler, engine)
    sample_steps(sampler, requests, vocab, "cpu", steps=1)
    host = sampler.masks.host
    assert host.shape == (9, -(-vocab // 32))
    pointer = host.data_ptr()
    sample_steps(sampler, requests, vocab, "cpu", steps=3)
    assert sampler.masks.host is host and host.data_ptr() == pointer


def test_a_moved_matcher_is_masked_at_its_new_state(compiler, engine):
    """Accepted (a verify chunk's earlier row) or rolled back between two masks of the same buffer."""
    vocab = engine.config.text.unpadded_vocab_size
    request = constrained(
        compiler, engine, "moved", OutputConstraint("regex", "(yes|no)"), prompt=[*PROMPT, MESSAGE_MODEL]
    )
    masks = GrammarMasks(1)
    first = torch.zeros(1, vocab)
    masks.apply(first, [request])
    assert set(torch.isfinite(first[0]).nonzero().flatten().tolist()) == {CONTENT_TEXT}
    masks.advance([request], [CONTENT_TEXT])
    after = torch.zeros(1, vocab)
    masks.apply(after, [request])
    allowed = set(torch.isfinite(after[0]).nonzero().flatten().tolist())
    assert torch.equal(after, mask_logits(torch.zeros(1, vocab), [request]))  # a fresh fill of the new state
    assert CONTENT_TEXT not in allowed and encode_text("yes")[0] in allowed
    masks.advance([request], [encode_text("yes")[0]])
    request.constraint.rollback(1)
    again = torch.zeros(1, vocab)
    masks.apply(again, [request])
    assert torch.equal(again, after)
    assert masks.masked_rows == 3


def test_masks_apply_in_place_unless_logprobs_are_asked(compiler, engine):
    vocab = engine.config.text.unpadded_vocab_size
    constraint = OutputConstraint("regex", "(yes|no)")
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3))
    raw = logits.clone()
    wants = constrained(compiler, engine, "lp", constraint, SamplingParams(temperature=0.0, logprobs=2))
    result = Sampler(max_rows=1).sample(logits, [wants])[0]
    assert result.token_id == MESSAGE_MODEL and torch.equal(logits, raw)
    assert result.logprobs.logprob == pytest.approx(float(torch.log_softmax(raw[0], -1)[MESSAGE_MODEL]))
    plain = constrained(compiler, engine, "no-lp", constraint)
    assert Sampler(max_rows=1).sample(logits, [plain])[0].token_id == MESSAGE_MODEL
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [MESSAGE_MODEL]  # masked in place: no copy


@pytest.mark.gpu
def test_json_schemas_on_cuda_graphs(compiler, checkpoint, cuda_device):
    """The engine on CUDA, decode steps replayed from CUDA graphs with the masks queued behind them: JSON objects
    with the required keys that stop, every output token masked, and the tokens of the eager step."""
    from common.settings import DecodeEngineSettings
    from decode_service.engine.build import build_engine

    tokens = {}
    for graphs in (True, False):
        settings = DecodeEngineSettings(
            device="cuda",
            kv_cache_bytes=16 << 20,
            max_num_seqs=8,
            max_num_batched_tokens=512,
            enable_prefix_cache=False,
            cuda_graphs=graphs,
        )
        gpu = build_engine(checkpoint, settings)
        requests = [
            constrained(compiler, gpu, name, OutputConstraint("json_schema", json.dumps(schema)))
            for name, schema in SCHEMAS.items()
        ]
        outs = gpu.generate(requests)
        for out in outs:
            assert out.finish_reason == "stop", (out.request_id, out.token_ids)
            document = json.loads(parse(out.token_ids)[0])
            assert set(SCHEMAS[out.request_id]["required"]) <= set(document)
        masks = gpu.runner.sampler.masks
        assert masks.masked_rows == sum(len(o.token_ids) for o in outs)
        tokens[graphs] = [o.token_ids for o in outs]
    assert tokens[True] == tokens[False]


@pytest.mark.gpu
def test_masked_choice_never_waits_for_the_device_gpu(compiler, engine, cuda_device):
    """The masks' fill, copies and kernel launch are all queued behind whatever produced the logits
    (the forward): no host sync before the read of the tokens, which are those of the masks filled on the CPU.
    Greedy rows only: the seeded/filtered sampling path still syncs somewhere (engine/worker/test_sampler.py)."""
    vocab = engine.config.text.unpadded_vocab_size
    requests = [r for r in mixed_batch(compiler, engine) if r.sampling.greedy]
    sampler = Sampler(max_rows=9, device=cuda_device)
    sample_steps(sampler, requests, vocab, cuda_device, steps=1)  # buffers, the kernel's compilation
    logits = (torch.randn(len(requests), vocab, generator=torch.Generator().manual_seed(5)) * 4).to(cuda_device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = sampler.choose(logits.clone(), requests)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert requests and tokens.tolist() == mask_logits(logits.cpu(), requests).argmax(-1).tolist()


class ScriptedDecoder:
    """A decoder whose logits are drawn on the host from one seeded stream (so every device sees the same ones)
    behind a forward that keeps a GPU busy for `busy_ms`: the engine queues the masks and the draw meanwhile."""

    def __init__(self, config, device, busy_ms: float = 0.0):
        self.hidden, self.vocab, self.dtype = config.hidden_size, config.unpadded_vocab_size, torch.float32
        self.device, self.generator = torch.device(device), torch.Generator().manual_seed(11)
        self.cycles = int(busy_ms * 1.5e6) if self.device.type == "cuda" else 0  # ~1.5 GHz clocks: order of ms

    def forward(self, batch):
        if self.cycles:
            torch.cuda._sleep(self.cycles)
        return torch.zeros(batch.num_tokens, self.hidden, device=self.device)

    def logits(self, hidden):
        scores = torch.randn(hidden.shape[0], self.vocab, generator=self.generator) * 4
        return scores.to(self.device, non_blocking=True)


def scripted_outputs(compiler, engine, device):
    """Greedy constrained and plain requests through an engine on the scripted decoder -> (tokens, reason) each."""
    from decode_service.engine.engine import Engine, EngineSettings

    settings = EngineSettings(
        kv_cache_bytes=16 << 20, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_cache=False, device=device
    )
    scripted = Engine(ScriptedDecoder(engine.config.text, device, busy_ms=2.0), engine.config, settings)
    requests = [
        constrained(compiler, scripted, f"c-{name}", OutputConstraint("json_schema", json.dumps(SCHEMAS[name])))
        for name in ("enum", "nested", "array_bounds", "optional", "any_of")
    ]
    requests.append(constrained(compiler, scripted, "regex", OutputConstraint("regex", "(yes|no)")))
    requests.append(Request("plain", list(PROMPT), SamplingParams(temperature=0.0, max_tokens=12)))
    return [(o.token_ids, o.finish_reason) for o in scripted.generate(requests)]


def test_scripted_constrained_outputs_stop_when_complete(compiler, engine):
    outputs = scripted_outputs(compiler, engine, "cpu")
    assert [reason for _, reason in outputs] == ["stop"] * 6 + ["length"]
    for tokens, _ in outputs[:6]:
        assert tokens[-2:] == [END_MESSAGE, MODEL_END_SAMPLING]  # the block closes, then the EOS ends it


@pytest.mark.gpu
def test_constrained_outputs_on_the_gpu_equal_those_on_the_cpu(compiler, engine, cuda_device):
    """The same logits on both devices: on the GPU the masks and the draw are queued behind a busy forward (no
    host sync before the tokens' read), on the CPU everything runs in order; every token and every finishing step
    (a complete grammar stops on the step it is complete) is the same."""
    assert scripted_outputs(compiler, engine, str(cuda_device)) == scripted_outputs(compiler, engine, "cpu")
