"""Tensor / expert parallel ranks (gloo, one process per rank) give the single-process logits (issue 14).

One spawn of 4 ranks per module: the layouts TP=2, TP=2 with expert parallelism, TP=4 and TP=4 with expert
parallelism run one after the other on subgroups of it, each on a bf16 and an NVFP4 tiny checkpoint, through
every scenario (MTP depths included); the parent compares rank 0's logits with the single-process model's.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.checkpoint import CheckpointFiles, load_decoder_weights, load_mtp_weights
from common.checkpoint_shard import load_decoder_shard, load_mtp_shard
from common.config import load_model_config
from common.errors import ConfigError
from common.tensor_parallel import plan_rank
from decode_service.model.batch import ForwardBatch, SequenceSlice
from decode_service.model.collectives import TPGroup
from decode_service.model.inkling import InklingDecoder
from decode_service.model.mtp import MTPDrafter
from decode_service.model.ops import bf16_experts_reference
from decode_service.model.parallel import build_rank_decoder, local_text_config, tp_group
from inkling_kernels.moe import MASKED_ROUTE
from tools.make_tiny_checkpoint import make_tiny_checkpoint

# 7 routed experts: uneven under expert parallelism over 2 (4 + 3) and 4 ranks (2 + 2 + 2 + 1). The tiny
# model's global layers have 1 KV head and its sliding layers 2, so TP=2 and TP=4 replicate KV heads. Vocab 510
# is not divisible by 4 (the last shard is padded); I = 64 keeps NVFP4 w2 K-slices on 16-element blocks at TP=4.
TINY = {"vocab_size": 510, "unpadded_vocab_size": 500, "n_routed_experts": 7, "intermediate_size": 64}
WORLD = 4
LAYOUTS = {"tp2": (2, False), "ep2": (2, True), "tp4": (4, False), "ep4": (4, True)}
SEQ_LEN = 60  # > the window (16) and rel_extent (32)
CHUNKS = [5, 11, 16, 9, 1, 1, 1]  # chunked prefill, then decode steps
MM_INDEX = [3, 4, 5, 20, 21]
RTOL = 1e-5  # max |diff| / max |logit|


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, TINY["unpadded_vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


def _chunks(model: InklingDecoder, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    state, out, pos = model.new_state(), [], 0
    for n in chunks:
        out.append(model.logits(model(ForwardBatch(ids[pos : pos + n], [SequenceSlice(pos, n, state.layers)]))))
        pos += n
    return torch.cat(out)


def _drafts(model: InklingDecoder, drafter: MTPDrafter, ids: torch.Tensor) -> torch.Tensor:
    """Every depth's draft logits over a prompt, chained from the trunk's hidden (depth d pairs row i with
    token i + d + 1)."""
    n = ids.shape[0] - drafter.num_depths
    hidden = model(ForwardBatch(ids[:n], [SequenceSlice(0, n, model.new_state().layers)]))
    state, out = drafter.new_state(), []
    for d in range(drafter.num_depths):
        batch = ForwardBatch(ids[d + 1 : d + 1 + n], [SequenceSlice(0, n, state.layers)])
        hidden = drafter(d, hidden, batch)
        out.append(drafter.logits(hidden))
    return torch.cat(out)


@torch.no_grad()
def scenarios(model: InklingDecoder, drafter: MTPDrafter) -> dict[str, torch.Tensor]:
    """Logits of every scenario; the same calls on every rank (the collectives pair up)."""
    ids = _ids(SEQ_LEN, 1)
    out = {
        "mtp": _drafts(model, drafter, ids[:40]),
        "text": _chunks(model, ids, [SEQ_LEN]),
        "chunked": _chunks(model, ids[: sum(CHUNKS)], CHUNKS),
    }
    rows = torch.randn(len(MM_INDEX), model.config.hidden_size, generator=torch.Generator().manual_seed(8)) * 3
    state = model.new_state()
    batch = ForwardBatch(ids[:40], [SequenceSlice(0, 40, state.layers)], mm_rows=rows, mm_index=torch.tensor(MM_INDEX))
    out["multimodal"] = model.logits(model(batch))
    a, b = model.new_state(), model.new_state()  # two sequences packed in one forward, then one decode step each
    first = ForwardBatch(
        torch.cat([ids[:20], ids[30:37]]), [SequenceSlice(0, 20, a.layers), SequenceSlice(0, 7, b.layers)]
    )
    second = ForwardBatch(ids[20:21].repeat(2), [SequenceSlice(20, 1, a.layers), SequenceSlice(7, 1, b.layers)])
    out["packed"] = torch.cat([model.logits(model(first)), model.logits(model(second))])
    return out


def _rank_main(rank: int, init: str, checkpoints: dict[str, str], out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120)
    )
    torch.set_num_threads(1)
    pair = dist.new_group([0, 1])  # every rank takes part in creating each group
    for name, (size, ep) in LAYOUTS.items():
        if rank < size:
            for kind, directory in checkpoints.items():
                config = load_model_config(directory)
                weights, _, plan = load_decoder_shard(
                    CheckpointFiles(directory), config, size, rank, ep, torch.float32, progress=False
                )
                group = pair if size == 2 else None
                model = build_rank_decoder(config.text, weights, plan, group, torch.float32, ops="reference")
                mtp, _ = load_mtp_shard(CheckpointFiles(directory), config, plan, torch.float32, progress=False)
                result = scenarios(model, MTPDrafter.from_weights(mtp, config.mtp, model))
                result["numel"] = torch.tensor(sum(t.numel() for t in model.state_dict().values()))
                torch.save(result, os.path.join(out_dir, f"{name}-{kind}-rank{rank}.pt"))
        dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny-tp")
    return {
        kind: str(make_tiny_checkpoint(root / kind, nvfp4=kind == "nvfp4", seed=3, **TINY))
        for kind in ("bf16", "nvfp4")
    }


@pytest.fixture(scope="module")
def rank_results(checkpoints, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tp-out")
    init = f"file://{out / 'rendezvous'}"
    mp.start_processes(_rank_main, args=(init, checkpoints, str(out)), nprocs=WORLD, join=True, start_method="spawn")
    return str(out)


@pytest.fixture(scope="module")
def references(checkpoints) -> dict[str, tuple[dict, int]]:
    out = {}
    for kind, directory in checkpoints.items():
        config = load_model_config(directory)
        weights, _ = load_decoder_weights(CheckpointFiles(directory), config, dtype=torch.float32, progress=False)
        model = InklingDecoder.from_weights(config.text, weights, torch.float32, ops="reference")
        mtp, _ = load_mtp_weights(CheckpointFiles(directory), config, dtype=torch.float32, progress=False)
        out[kind] = (
            scenarios(model, MTPDrafter.from_weights(mtp, config.mtp, model)),
            sum(t.numel() for t in model.state_dict().values()),
        )
    return out


@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_ranks_equal_single_process_logits(rank_results, references, layout, kind):
    size, _ = LAYOUTS[layout]
    ref, full_numel = references[kind]
    per_rank = [torch.load(os.path.join(rank_results, f"{layout}-{kind}-rank{r}.pt")) for r in range(size)]
    for scenario, expected in ref.items():
        assert expected.shape[-1] == TINY["unpadded_vocab_size"]
        for r, got in enumerate(per_rank):
            assert got[scenario].shape == expected.shape, (scenario, r)
            rel = ((got[scenario] - expected).abs().max() / expected.abs().max()).item()
            assert rel <= RTOL, f"{layout} {kind} {scenario} rank {r}: max |diff| / max |logit| = {rel:.2e}"
    for r, got in enumerate(per_rank):  # each rank holds a shard, not the whole model
        assert int(got["numel"]) < full_numel * 0.75, (layout, r)


def test_kv_heads_are_replicated_where_tp_exceeds_them(checkpoints):
    config = load_model_config(checkpoints["bf16"])
    assert config.text.num_kv_heads == 1 and config.text.swa_num_kv_heads == 2
    for size in (2, 4):
        local = local_text_config(config.text, plan_rank(config, size, size - 1))
        assert (local.num_heads, local.num_kv_heads) == (4 // size, 1)
        assert (local.swa_num_heads, local.swa_num_kv_heads) == (4 // size, max(1, 2 // size))


def test_expert_parallel_needs_an_expert_on_every_rank(checkpoints):
    config = load_model_config(checkpoints["bf16"])
    small = dataclasses.replace(config.text, n_routed_experts=3)
    plan = plan_rank(dataclasses.replace(config, text=small), 4, 3, expert_parallel=True)
    with pytest.raises(ConfigError, match="leave rank 3 with none"):
        tp_group(small, plan, None)


def test_expert_parallel_routes_to_other_ranks_reach_no_expert():
    """Rank 1 of 2 holding experts 3..5: routes to the others are masked (id MASKED_ROUTE, weight 0), and the
    reference experts compute none of them: a token routed only elsewhere has a NaN input and still gets 0."""
    tp = TPGroup(2, 1, None, 0, (3, 6), 8)
    ids = torch.tensor([[0, 4], [5, 2], [1, 6]])
    weights = torch.tensor([[0.25, 0.75], [0.5, 0.5], [0.5, 0.5]])
    local, local_weights = tp.local_routes(ids, weights)
    assert local.tolist() == [[MASKED_ROUTE, 1], [2, MASKED_ROUTE], [MASKED_ROUTE, MASKED_ROUTE]]
    assert local_weights.tolist() == [[0.0, 0.75], [0.5, 0.0], [0.0, 0.0]]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, generator=gen)
    x[2] = float("nan")
    w13, w2 = torch.randn(3, 16, 16, generator=gen), torch.randn(3, 16, 8, generator=gen)
    out = bf16_experts_reference(x, local, weights, w13, w2)  # the unmasked weights: masking alone drops them
    assert torch.equal(out[2], torch.zeros(16))
    only = bf16_experts_reference(
        x[:2], torch.tensor([[1, 1], [2, 2]]), torch.tensor([[0.75, 0.0], [0.5, 0.0]]), w13, w2
    )
    torch.testing.assert_close(out[:2], only)
