"""Dynamic batching: results equal unbatched calls, requests really coalesce, budget, cancellation, errors."""

import asyncio
import threading

import numpy as np
import pytest
import torch

from common.config import AudioConfig, VisionConfig
from common.errors import UnavailableError
from encoder_service.batcher import DynamicBatcher
from encoder_service.service import bf16_bits
from encoder_service.towers import AudioTower, VisionTower


def _vision() -> VisionTower:
    torch.manual_seed(0)
    tower = VisionTower(
        VisionConfig(patch_size=8, temporal_patch_size=2, num_channels=3, num_layers=3, output_dim=32, use_norm=True)
    )
    for p in tower.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return tower.to(torch.bfloat16).eval()


def _run(tower: torch.nn.Module):
    def run(x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return bf16_bits(tower(torch.from_numpy(x)))

    return run


def test_batched_vision_equals_unbatched():
    tower = _vision()
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((n, 8, 8, 3)).astype(np.float32) for n in (3, 1, 7, 2)]
    unbatched = [_run(tower)(x) for x in inputs]
    sizes: list[int] = []

    async def main() -> list[np.ndarray]:
        batcher = DynamicBatcher(
            _run(tower), max_batch_rows=64, max_wait_s=0.05, observer=lambda items, rows, wait, run: sizes.append(items)
        )
        try:
            return await asyncio.gather(*(batcher.submit(x) for x in inputs))
        finally:
            await batcher.close()

    batched = asyncio.run(main())
    assert sizes == [4]  # one tower call for all four requests
    for a, b in zip(batched, unbatched, strict=True):
        assert np.array_equal(a, b)


def test_batched_audio_equals_unbatched():
    torch.manual_seed(1)
    tower = AudioTower(
        AudioConfig(
            n_mel_bins=80, mel_vocab_size=16, dmel_min_value=-7.0, dmel_max_value=2.0, output_dim=32, use_norm=True
        )
    )
    torch.nn.init.normal_(tower.encoder.weight)
    tower = tower.to(torch.bfloat16).eval()
    rng = np.random.default_rng(1)
    inputs = [rng.integers(0, 16, (n, 80), dtype=np.uint8) for n in (5, 9)]

    async def main() -> list[np.ndarray]:
        batcher = DynamicBatcher(_run(tower), max_batch_rows=64, max_wait_s=0.05)
        try:
            return await asyncio.gather(*(batcher.submit(x) for x in inputs))
        finally:
            await batcher.close()

    for a, x in zip(asyncio.run(main()), inputs, strict=True):
        assert np.array_equal(a, _run(tower)(x))


def test_row_budget_splits_batches_and_oversize_runs_alone():
    batches: list[int] = []

    async def main() -> list[np.ndarray]:
        batcher = DynamicBatcher(
            lambda x: x * 2,
            max_batch_rows=4,
            max_wait_s=0.05,
            observer=lambda items, rows, wait, run: batches.append(rows),
        )
        try:
            return await asyncio.gather(*(batcher.submit(np.full(n, n)) for n in (3, 2, 6, 1)))
        finally:
            await batcher.close()

    out = asyncio.run(main())
    assert [list(o) for o in out] == [[6] * 3, [4] * 2, [12] * 6, [2]]
    assert max(batches) == 6 and all(b <= 4 for b in batches if b != 6)


def test_cancelled_caller_is_dropped_and_errors_propagate():
    gate = threading.Event()
    seen: list[int] = []

    def run(x: np.ndarray) -> np.ndarray:
        gate.wait(5)
        seen.append(len(x))
        if (x < 0).any():
            raise ValueError("tower failed")
        return x

    async def main() -> None:
        batcher = DynamicBatcher(run, max_batch_rows=100, max_wait_s=0.0)
        first = asyncio.create_task(batcher.submit(np.ones(1)))  # occupies the tower
        await asyncio.sleep(0.05)
        doomed = asyncio.create_task(batcher.submit(np.ones(5)))
        kept = asyncio.create_task(batcher.submit(np.ones(2)))
        await asyncio.sleep(0.01)
        doomed.cancel()
        gate.set()
        assert len(await first) == 1 and len(await kept) == 2
        with pytest.raises(ValueError, match="tower failed"):
            await batcher.submit(-np.ones(3))
        await batcher.close()
        with pytest.raises(UnavailableError):
            await batcher.submit(np.ones(1))

    asyncio.run(main())
    assert 5 not in seen and 7 not in seen
