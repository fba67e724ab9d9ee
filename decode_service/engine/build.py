"""A checkpoint and the decode service's engine settings -> an `Engine` (one process, or rank 0 of a
tensor-parallel replica whose other ranks `engine/parallel.py` starts)."""

from __future__ import annotations

from pathlib import Path

from common.checkpoint import CheckpointFiles, load_decoder_weights, load_mtp_weights
from common.config import load_model_config
from common.dtypes import torch_dtype
from common.errors import ConfigError
from common.fingerprint import model_fingerprint
from common.settings import DecodeEngineSettings
from decode_service.engine.engine import Engine, EngineSettings
from decode_service.engine.parallel import PrefixConnection, launch_engine
from decode_service.engine.worker.prefix_store import PrefixStore
from decode_service.model.inkling import InklingDecoder
from decode_service.model.mtp import MTPDrafter


def build_engine(
    checkpoint: str | Path,
    settings: DecodeEngineSettings | None = None,
    prefix_store: PrefixStore | None = None,
    prefix_connection: PrefixConnection | None = None,
) -> Engine:
    """Load the decoder weights of a checkpoint and wrap them in an `Engine` (`prefix_store`: the shared Redis
    prefix tier). The prefix and Redis keys carry `common.fingerprint.model_fingerprint` (config, dtype, weights).
    With `tensor_parallel_size` > 1 the other ranks start as child processes (`engine/parallel.py`) and this
    process holds rank 0; with a `prefix_store` they connect their own from `prefix_connection`."""
    settings = settings or DecodeEngineSettings()
    dtype = torch_dtype(settings.dtype)
    engine_settings = EngineSettings(
        kv_cache_bytes=settings.kv_cache_bytes,
        page_size=settings.page_size,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=settings.max_model_len,
        enable_prefix_cache=settings.enable_prefix_cache,
        snapshot_interval_blocks=settings.snapshot_interval_blocks,
        device=settings.device,
        seed=settings.seed,
        model_fingerprint=model_fingerprint(checkpoint, settings.dtype),
        cuda_graphs=settings.cuda_graphs,
        async_scheduling=settings.async_scheduling,
        mtp_depth=settings.mtp_depth,
        mtp_acceptance=settings.mtp_acceptance,
        mtp_draft_head=settings.mtp_draft_head,
    )
    if settings.tensor_parallel_size > 1:
        return launch_engine(
            checkpoint,
            engine_settings,
            dtype,
            settings.tensor_parallel_size,
            settings.expert_parallel,
            prefix_store,
            prefix_connection,
        )
    config = load_model_config(checkpoint)
    weights, _ = load_decoder_weights(CheckpointFiles(checkpoint), config, dtype=dtype, device=settings.device)
    model = InklingDecoder.from_weights(config.text, weights, dtype, settings.device)
    drafter = None
    if settings.mtp_depth:
        if config.mtp is None:
            raise ConfigError(f"--mtp-depth={settings.mtp_depth}: the checkpoint has no MTP drafter (mtp_config)")
        mtp, _ = load_mtp_weights(CheckpointFiles(checkpoint), config, dtype=dtype, device=settings.device)
        drafter = MTPDrafter.from_weights(mtp, config.mtp, model, head=settings.mtp_draft_head)
    return Engine(model, config, engine_settings, prefix_store, drafter)
