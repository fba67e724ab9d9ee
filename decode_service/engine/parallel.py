"""Start the N ranks of a tensor / expert parallel decode replica (issue 14) and build rank 0's engine.

Rank 0 is the calling (server) process; ranks 1..N-1 are spawned child processes that exit with it. Every rank
joins one `torch.distributed` world over 127.0.0.1 (NCCL on `cuda`, rank r on GPU r of the visible ones; gloo on
`cpu`), reads only its slices of the checkpoint (`common.checkpoint_shard`), builds its sharded decoder
(`decode_service.model.parallel`; with `--mtp-depth`, its shard of the MTP depths too) and an `Engine` over it with
the same settings, so every rank sizes the same number of KV pages (of its local heads) and captures the same
decode graphs. Rank 0's engine leads (`worker/ranks.py`); the others follow with their engine's runner, without
sampling.

Groups: the model's collectives run on a group with the step timeout (a peer that stops answering fails the step
instead of hanging it); the step messages go over a gloo control group without one (followers wait there while
the replica is idle). With the shared Redis prefix tier every rank writes its own KV shards and rank 0 reads
them all (`worker/sharded_tier.py`). Rank 0 logs the per-rank memory plan before loading (`common.memory_plan`);
on CUDA a model that does not fit raises a `ConfigError` naming the bytes and the size that would fit.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from common.checkpoint import CheckpointFiles, plan_decoder_weights
from common.checkpoint_shard import load_decoder_shard, load_mtp_shard
from common.config import ModelConfig, load_model_config
from common.errors import ConfigError
from common.memory_plan import MemoryRequest, plan_fitting, plan_memory
from common.settings import RedisPrefixSettings, RedisSettings
from decode_service.engine.engine import Engine, EngineSettings
from decode_service.engine.worker.prefix_store import PrefixStore
from decode_service.engine.worker.ranks import RankLeader, follow
from decode_service.engine.worker.runner import ModelRunner
from decode_service.engine.worker.sharded_tier import FollowerPrefixTier
from decode_service.model.mtp import MTPDrafter
from decode_service.model.parallel import build_rank_decoder

log = logging.getLogger(__name__)

PrefixConnection = tuple[RedisSettings, RedisPrefixSettings]  # how a follower connects its own prefix store

RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=5)  # every rank joins before loading (a spawn and torch's import)
IDLE_TIMEOUT = datetime.timedelta(days=365)  # followers wait for the next step as long as the replica lives
STEP_TIMEOUT = datetime.timedelta(seconds=120)  # one step's collectives


def rank_device(device: str, rank: int) -> str:
    """`cuda` -> GPU `rank` of the visible ones; `cpu` stays `cpu`."""
    if device == "cpu":
        return "cpu"
    if torch.device(device).type != "cuda":
        raise ConfigError(f"--device={device!r}: tensor parallelism runs on cpu (gloo) or cuda (NCCL)")
    if torch.cuda.device_count() <= rank:
        raise ConfigError(f"--tensor-parallel-size needs GPU {rank}, but {torch.cuda.device_count()} are visible")
    return f"cuda:{rank}"


def _groups(rank: int, size: int, init: str, device: str) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(model group, control group) after joining the world."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=size, timeout=RENDEZVOUS_TIMEOUT)
    model_group = dist.new_group(list(range(size)), timeout=STEP_TIMEOUT, backend=backend)
    control = dist.new_group(list(range(size)), timeout=IDLE_TIMEOUT, backend="gloo")
    if backend == "nccl":  # NCCL communicators start lazily: make it before any decode graph captures a collective
        dist.all_reduce(torch.zeros(1, device=device), group=model_group)
        torch.cuda.synchronize(device)
    return model_group, control


def _rank_engine(
    checkpoint: str,
    config: ModelConfig,
    settings: EngineSettings,
    dtype: torch.dtype,
    rank: int,
    size: int,
    expert_parallel: bool,
    model_group: dist.ProcessGroup,
    sync: Callable[[], None],
    leader: RankLeader | None,
    prefix_store: PrefixStore | None = None,
) -> Engine:
    """Load the rank's shard (and, with `mtp_depth`, its shard of the MTP depths), wait for every rank (`sync`:
    loading times differ, and building the engine captures decode graphs whose warm-up runs the model's
    collectives), build the engine, `sync` again."""
    files = CheckpointFiles(checkpoint)
    weights, _, plan = load_decoder_shard(files, config, size, rank, expert_parallel, dtype, settings.device)
    model = build_rank_decoder(config.text, weights, plan, model_group, dtype, settings.device)
    drafter = None
    if settings.mtp_depth:
        mtp, _ = load_mtp_shard(files, config, plan, dtype, settings.device)
        # its depths shard like the trunk's layers, an FP8 head its vocabulary shard
        drafter = MTPDrafter.from_weights(mtp, config.mtp, model, head=settings.mtp_draft_head)
    sync()
    engine = Engine(model, config, settings, prefix_store, drafter, ranks=leader)
    sync()
    return engine


def memory_plan_summary(
    checkpoint: str, config: ModelConfig, settings: EngineSettings, dtype: torch.dtype, size: int, expert_parallel: bool
) -> str:
    """The per-rank memory plan (weights, KV pools, conv slots) of this replica; on CUDA a plan that does not fit
    the GPU raises `ConfigError`."""
    cuda = settings.device.startswith("cuda")
    device_bytes = (
        torch.cuda.get_device_properties(0).total_memory
        if cuda
        else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    )
    request = MemoryRequest(
        device_bytes=device_bytes,
        page_size=settings.page_size,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        kv_tokens=0,
        graph_bytes=0,
        dtype=settings.cache_dtype or dtype,
        include_mtp=settings.mtp_depth > 0,
    )
    _, _, report = plan_decoder_weights(CheckpointFiles(checkpoint), config, dtype)
    plan = (plan_fitting if cuda else plan_memory)(config, request, size, expert_parallel, report.nvfp4_layers)
    return plan.summary()


def launch_engine(
    checkpoint: str | Path,
    settings: EngineSettings,
    dtype: torch.dtype,
    size: int,
    expert_parallel: bool = False,
    prefix_store: PrefixStore | None = None,
    prefix_connection: PrefixConnection | None = None,
) -> Engine:
    """Start ranks 1..size-1 as child processes and return rank 0's (leading) engine. With the shared Redis
    prefix tier, `prefix_store` is rank 0's and every follower connects its own from `prefix_connection`."""
    if (prefix_store is None) != (prefix_connection is None):
        raise ConfigError("the Redis prefix tier of a tensor-parallel replica needs its store and its connection")
    checkpoint = str(checkpoint)
    config = load_model_config(checkpoint)
    if settings.mtp_depth and config.mtp is None:
        raise ConfigError(f"--mtp-depth={settings.mtp_depth}: the checkpoint has no MTP drafter (mtp_config)")
    if config.mtp is not None and settings.mtp_depth > config.mtp.num_layers:
        raise ConfigError(f"--mtp-depth={settings.mtp_depth}: the checkpoint's drafter has {config.mtp.num_layers}")
    rank_device(settings.device, size - 1)  # every GPU is there before anything starts
    log.info("%s", memory_plan_summary(checkpoint, config, settings, dtype, size, expert_parallel))
    init = f"tcp://127.0.0.1:{_free_port()}"
    context = mp.get_context("spawn")
    processes = [
        context.Process(
            target=_follower_main,
            args=(checkpoint, settings, dtype, rank, size, expert_parallel, init, prefix_connection),
            name=f"inkling-tp-rank{rank}",
            daemon=True,
        )
        for rank in range(1, size)
    ]
    for process in processes:
        process.start()
    try:
        local = _with_device(settings, 0)
        model_group, control = _groups(0, size, init, local.device)
        leader = RankLeader(size, control, processes)
        engine = _rank_engine(
            checkpoint,
            config,
            local,
            dtype,
            0,
            size,
            expert_parallel,
            model_group,
            leader.wait_for_followers,
            leader,
            prefix_store,
        )
        if engine.redis_prefix is not None:  # runs scratch prefills on every rank: the followers follow now
            engine.calibrate_prefix_tier()
    except BaseException:
        for process in processes:
            process.kill()
        raise
    pages = {("sliding" if kind else "global"): pool.num_pages for kind, pool in engine.cache.pools.items()}
    log.info(
        "tensor-parallel replica of %d ranks ready (followers: pids %s); KV pages per rank %s in %.1f MiB",
        size,
        [p.pid for p in processes],
        pages,
        settings.kv_cache_bytes / (1 << 20),
    )
    return engine


def _follower_main(
    checkpoint: str,
    settings: EngineSettings,
    dtype: torch.dtype,
    rank: int,
    size: int,
    expert_parallel: bool,
    init: str,
    prefix_connection: PrefixConnection | None,
) -> None:
    _exit_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: rank 0 drains, then ends us
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    local = _with_device(settings, rank)
    model_group, control = _groups(rank, size, init, local.device)
    config = load_model_config(checkpoint)
    engine = _rank_engine(
        checkpoint, config, local, dtype, rank, size, expert_parallel, model_group, lambda: dist.barrier(control), None
    )
    runner = engine.runner
    tier = None
    if prefix_connection is not None and engine.prefix_cache is not None:  # as rank 0's engine decides
        store = PrefixStore.connect(*prefix_connection)
        tier = FollowerPrefixTier(engine.kv, engine.prefix_cache.fingerprint, store, rank, size)
    follower = ModelRunner(
        runner.model, runner.cache, None, runner.device, runner.decode_graphs, tier, runner.drafter, runner.tp
    )
    follow(follower, control)
    if tier is not None:
        tier.store.close()  # finish this rank's queued prefix writes
    dist.destroy_process_group()


def _with_device(settings: EngineSettings, rank: int) -> EngineSettings:
    return dataclasses.replace(settings, device=rank_device(settings.device, rank))


def _exit_with_parent() -> None:
    """A follower ends when rank 0's process does, however it ends."""
    parent = mp.parent_process()
    assert parent is not None, "a follower rank runs in a child process"

    def watch() -> None:
        parent.join()
        os._exit(0)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
