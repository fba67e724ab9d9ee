"""Token sampling and stop checks.

Order (vLLM semantics): penalties (repetition over prompt + output, presence/frequency over output) -> greedy
argmax or temperature -> min-p -> top-k -> top-p -> a draw with the request's own generator (exponential-race
sampling: `argmax(p / q)`, `q ~ Exp(1)`), so a seeded request gives the same tokens whatever it is batched
with. Logprobs are those of the raw model distribution. Logits arrive already sliced to the unpadded
vocabulary. Stop checks are the control plane's (`core/stop.py`); stop strings the output parser's.

Structured outputs (`decode_service.structured.sampling.GrammarMasks`): `sample` and `target_probs` fill the
constrained rows' masks on the host and mask the logits they are given in place (the runner hands over rows of its
own), on a copy only when a row asks for logprobs, which stay raw.

Nothing before the read of the chosen tokens waits for the device (`choose`; host values reach it through
`to_device`): the runner enqueues the logits, masks and draw right behind the forward, so their host work (the
masks' fill, copies and kernel launch) runs while the GPU is still in the forward, and `sample`'s `.tolist()` is
the step's one sync. Checked on the H200 (torch's sync debug mode) for greedy, seeded, filtered and penalised rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from decode_service.engine.request import SamplingParams, TokenLogprobs
from decode_service.structured.matcher import ConstraintMatcher
from decode_service.structured.sampling import GrammarMasks


@dataclass(frozen=True)
class SampleResult:
    token_id: int
    logprobs: TokenLogprobs | None = None
    constraint_finished: bool = False  # the request's structured-output grammar is complete: it stops here


class SamplingState(Protocol):
    """What sampling reads of a request (the data plane's `WorkerRequest`); `generator` is set on first use."""

    sampling: SamplingParams
    output_token_ids: list[int]
    generator: torch.Generator | None
    constraint: ConstraintMatcher | None

    @property
    def all_token_ids(self) -> list[int]: ...


class Sampler:
    """`max_rows`: the most rows one call samples (the engine's `max_num_seqs`); `device`: the logits'."""

    def __init__(self, seed: int = 0, max_rows: int = 256, device: torch.device | str = "cpu"):
        self._seeder = torch.Generator().manual_seed(seed)  # seeds requests that bring no seed of their own
        self.masks = GrammarMasks(max_rows, device)

    def generator(self, request: SamplingState, device: torch.device) -> torch.Generator:
        if request.generator is None:
            seed = request.sampling.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (), generator=self._seeder))
            request.generator = torch.Generator(device=device).manual_seed(seed)
        return request.generator

    def sample(self, logits: torch.Tensor, requests: Sequence[SamplingState]) -> list[SampleResult]:
        """logits `[N, V]` (one row per request; the grammar masks may overwrite them) -> one token per request."""
        assert logits.shape[0] == len(requests)
        logits = logits.float()
        return self.emit(logits, requests, self.choose(logits, requests).tolist())

    def choose(self, logits: torch.Tensor, requests: Sequence[SamplingState]) -> torch.Tensor:
        """The token of each row `[N]` on the logits' device, queued behind what produced them: no host sync."""
        params = [r.sampling for r in requests]
        x = self._masked(logits, requests)
        tokens = x.argmax(-1)
        if all(p.greedy for p in params):
            return tokens
        probs = filtered_probs(x, params)
        noise = torch.stack(
            [
                torch.empty(x.shape[1], device=x.device).exponential_(generator=self.generator(r, x.device))
                if not p.greedy
                else torch.ones(x.shape[1], device=x.device)
                for r, p in zip(requests, params, strict=True)
            ]
        )
        greedy = to_device([p.greedy for p in params], x.device)
        return torch.where(greedy, tokens, (probs / noise).argmax(-1))

    def target_probs(self, logits: torch.Tensor, requests: Sequence[SamplingState]) -> torch.Tensor:
        """The distribution `sample` draws each row from, normalised `[N, V]` (penalties, mask, temperature,
        filters); speculative verification compares drafts against it. Non-greedy requests only."""
        assert not any(r.sampling.greedy for r in requests), "greedy rows have no distribution to verify against"
        x = self._masked(logits.float(), requests)
        probs = filtered_probs(x, [r.sampling for r in requests])
        return probs / probs.sum(-1, keepdim=True)

    def _masked(self, logits: torch.Tensor, requests: Sequence[SamplingState]) -> torch.Tensor:
        """Penalties and grammar masks; `logits` itself is overwritten unless a row wants (raw) logprobs."""
        x = apply_penalties(logits, requests)
        constrained = any(r.constraint is not None for r in requests)
        if x is logits and constrained and any(r.sampling.logprobs is not None for r in requests):
            x = logits.clone()
        self.masks.apply(x, requests)
        return x

    def emit(
        self, logits: torch.Tensor, requests: Sequence[SamplingState], token_list: list[int]
    ) -> list[SampleResult]:
        """Tokens chosen for the rows of `logits`: advance the constraints, compute the logprobs asked for."""
        logits = logits.float()
        params = [r.sampling for r in requests]
        results = []
        self.masks.advance(requests, token_list)
        want = [p.logprobs for p in params]
        raw = torch.log_softmax(logits, -1) if any(n is not None for n in want) else None
        for row, (token, n) in enumerate(zip(token_list, want, strict=True)):
            info = None
            if n is not None:
                pairs: tuple[tuple[int, float], ...] = ()
                if n:
                    top = torch.topk(raw[row], n)
                    pairs = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
                info = TokenLogprobs(float(raw[row, token]), pairs)
            constraint = requests[row].constraint
            results.append(SampleResult(token, info, constraint is not None and constraint.is_terminated))
        return results


def argmax_only(request: SamplingState) -> bool:
    """Whether `Sampler.sample` returns this request's token as the argmax of its raw logits and nothing else:
    greedy, no penalties, no grammar, no logprobs (the decode graphs' in-graph argmax, worker/runner.py)."""
    p = request.sampling
    no_penalty = p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
    return p.greedy and no_penalty and request.constraint is None and p.logprobs is None


def samples_on_device(request: SamplingState) -> bool:
    """Whether `Sampler.choose` alone gives this request's token, with nothing on the host before or after it: no
    penalties (they read the host's token history), no grammar, no logprobs (async scheduling, worker/runner.py)."""
    p = request.sampling
    no_penalty = p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
    return no_penalty and request.constraint is None and p.logprobs is None


def apply_penalties(logits: torch.Tensor, requests: Sequence[SamplingState]) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens; presence and frequency penalties over output tokens."""
    params = [r.sampling for r in requests]
    if all(p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 for p in params):
        return logits
    out = logits.clone()
    vocab = logits.shape[1]
    for row, (request, p) in enumerate(zip(requests, params, strict=True)):
        if p.repetition_penalty != 1.0:
            ids = to_device(request.all_token_ids, logits.device)
            seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device).index_fill_(0, ids, True)  # no sync
            penalized = torch.where(out[row] > 0, out[row] / p.repetition_penalty, out[row] * p.repetition_penalty)
            out[row] = torch.where(seen, penalized, out[row])
        if request.output_token_ids and (p.presence_penalty or p.frequency_penalty):
            ids = to_device(request.output_token_ids, logits.device)
            counts = out.new_zeros(vocab).index_add_(0, ids, out.new_ones(len(ids)))  # bincount reads its max back
            out[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return out


def filtered_probs(logits: torch.Tensor, params: Sequence) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p masks; rows need no renormalising (the draw is scale-free)."""
    device, vocab = logits.device, logits.shape[1]
    temperature = to_device([p.temperature if not p.greedy else 1.0 for p in params], device)
    min_p = to_device([p.min_p for p in params], device)
    top_k = to_device([p.top_k if p.top_k > 0 else vocab for p in params], device)
    top_p = to_device([p.top_p for p in params], device)

    probs = torch.softmax(logits / temperature[:, None], dim=-1)  # [N, V]
    probs = torch.where(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, 0.0, probs)
    if all(p.top_k in (0, vocab) and p.top_p == 1.0 for p in params):
        return probs  # no rank-based filter: skip the sort
    sorted_probs, order = probs.sort(-1, descending=True)
    ranks = torch.arange(vocab, device=device)
    sorted_probs = torch.where(ranks[None, :] >= top_k[:, None], 0.0, sorted_probs)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # probability of strictly better tokens
    total = sorted_probs.sum(-1, keepdim=True)
    sorted_probs = torch.where(mass_before >= top_p[:, None] * total, 0.0, sorted_probs)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


def to_device(values: Sequence, device: torch.device | str) -> torch.Tensor:
    """Host values as a tensor on `device`, without waiting for it: `torch.tensor(values, device=cuda)` copies
    synchronously (a stream sync, so the host would wait for the forward); a non-blocking copy from pageable
    memory is staged by the driver before it returns, so the temporary may go at once."""
    return torch.tensor(values).to(device, non_blocking=True)
