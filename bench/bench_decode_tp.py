"""Tensor-parallel decode step (issue 14): full-depth Inkling-Small or Inkling shapes over N ranks, one per GPU.

`python3 -m bench.bench_decode --tensor-parallel-size N [--model small|inkling] [--enable-expert-parallel]` runs
this. Each rank is a process (NCCL on GPU r; `--device cpu`: gloo) that builds its own shard of a random model
directly on its device: the shapes come from the rank's `RankPlan` (common/tensor_parallel.py) through
`parallel.build`'s local config and `TPGroup`, so the modules, KV pools and collectives are the serving ones.
Layers 0-1 are dense, layer 2's routed experts bf16, every later MoE layer's in the packed NVFP4 layout (codes and
e4m3 block scales generated as bytes). Replicated tensors (norms, router, residual convs, relative-bias bank) are
drawn from one seed on every rank, sharded ones from a per-rank seed.

Per (ctx, B): the engine's batched decode step (`DecodeGraphs` over the paged cache holding random history) run
eagerly and replayed from its CUDA graph (wall time, metadata fill included), the greedy tokens of the two compared
(gathered logits, the unpadded vocab), and the floor: the per-GPU bytes of `bench.proxy.step_bytes` on the rank's
shard (the slowest rank's) over the copy bandwidth measured in the same run, plus 2 x layers x the all-reduce
latency of this step's message (`[B, H]` bf16) measured in the same run over the same group. The logits all-gather
is not in the floor. `--tiny --device cpu` runs the same code at make-tiny shapes over gloo (CI smoke test).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import tempfile
import zlib
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.floors import Ceilings, measure_ceilings, time_host_ms, time_ms
from bench.proxy import paged_decode_batch, random_tensor, step_bytes, touched_experts
from common.config import ModelConfig, parse_model_config
from common.tensor_parallel import REPLICATED, ROW, RankPlan, plan_rank
from decode_service.engine.worker.decode_graphs import DecodeGraphs
from decode_service.model.inkling import InklingDecoder
from decode_service.model.parallel import local_text_config, tp_group
from tools.make_tiny_checkpoint import raw_config
from tools.model_shapes import INKLING, INKLING_SMALL

PAGE = 16
TINY = {"vocab_size": 512, "unpadded_vocab_size": 500, "intermediate_size": 64}  # make-tiny, 6 layers
MODELS = {"small": INKLING_SMALL, "inkling": INKLING}


def model_config(name: str, tiny: bool) -> ModelConfig:
    return parse_model_config(raw_config(**(TINY if tiny else MODELS[name])))


def nvfp4_layers(config: ModelConfig) -> frozenset[int]:
    """Every MoE layer after the first (the first, layer 2 of the releases, keeps bf16 experts)."""
    moe = [i for i, dense in enumerate(config.text.dense_layers) if not dense]
    return frozenset(moe[1:])


@torch.no_grad()
def random_rank_model(
    config: ModelConfig, plan: RankPlan, group: dist.ProcessGroup | None, device: str, seed: int = 0
) -> InklingDecoder:
    """Rank `plan.rank`'s decoder with random weights made on `device` in the rank's local shapes."""
    text = config.text
    local, tp = local_text_config(text, plan), tp_group(text, plan, group)
    with torch.device("meta"):
        shapes = InklingDecoder(local, frozenset(plan.nvfp4_layers), tp=tp).state_dict()
    gen_device = torch.device(device)
    weights = {}
    for name, meta in shapes.items():
        shard = plan.shards.get(name)
        replicated = shard is not None and shard.rule == REPLICATED
        gen = torch.Generator(gen_device).manual_seed(
            seed * 1_000_003 + zlib.crc32(name.encode()) + (0 if replicated else 7919 * (plan.rank + 1))
        )
        shape = tuple(meta.shape)
        fan_in = shape[-1] * plan.size if shard is not None and shard.rule == ROW else None
        weights[name] = random_tensor(name, shape, meta.dtype, text, device, gen, fan_in)
    return InklingDecoder.from_weights(local, weights, torch.bfloat16, device, tp=tp)


def check_replicated(model: InklingDecoder, plan: RankPlan) -> int:
    """Raise unless every replicated tensor is equal on every rank (a checksum per tensor, compared over the
    group); returns how many were compared."""
    names = [n for n, _ in model.state_dict().items() if n in plan.shards and plan.shards[n].rule == REPLICATED]
    state = model.state_dict()
    sums = torch.tensor([state[n].double().sum().item() for n in names], dtype=torch.float64)
    low, high = sums.clone(), sums.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=_cpu_group(None))
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=_cpu_group(None))
    differ = [n for n, a, b in zip(names, low.tolist(), high.tolist(), strict=True) if a != b]
    if differ:
        raise RuntimeError(f"replicated tensors differ between ranks: {differ[:5]}")
    return len(names)


def kv_bytes(model: InklingDecoder, batch: int, ctx: int) -> int:
    """Bytes of the K/V pools `paged_decode_batch` allocates for B sequences at `ctx` (bf16)."""
    config = model.config
    window_pages = math.ceil(config.sliding_window / PAGE) + 2
    ctx_pages = math.ceil((ctx + 1) / PAGE)
    total = 0
    for layer in range(config.num_layers):
        geo = config.layer_geometry(layer)
        pages = batch * window_pages + ctx_pages if geo.window else batch * ctx_pages
        total += (pages + 1) * PAGE * 2 * geo.kv_width * 2
    return total


def all_reduce_ms(
    shape: tuple[int, ...], group: dist.ProcessGroup | None, device: str, reps: int = 50, warmup: int = 5
) -> float:
    """Median latency of one all-reduce of a bf16 tensor of `shape` over `group` (back-to-back calls, per call)."""
    x = torch.randn(shape, device=device).to(torch.bfloat16)

    def ten() -> None:
        for _ in range(10):
            dist.all_reduce(x, group=group)

    return time_ms(ten, device, reps=max(1, reps // 10), warmup=warmup) / 10


def host_ceilings(n_bytes: int = 64 << 20) -> Ceilings:
    """The CPU's copy bandwidth (bytes read + written over time); matmul peak not measured (0)."""
    src = torch.randint(0, 255, (n_bytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    ms = time_host_ms(lambda: dst.copy_(src), reps=5)
    return Ceilings(copy_gbs=2 * n_bytes / (ms * 1e-3) / 1e9, bf16_tflops=0.0, device="cpu")


def _max_over_ranks(value: float, group: dist.ProcessGroup | None) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_cpu_group(group))
    return float(t.item())


_CPU_GROUPS: dict = {}


def _cpu_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A gloo group over the same ranks for host-side scalars (the model group may be NCCL)."""
    if dist.get_backend(group) == "gloo":
        return group
    if group not in _CPU_GROUPS:
        _CPU_GROUPS[group] = dist.new_group(backend="gloo")
    return _CPU_GROUPS[group]


@dataclasses.dataclass(frozen=True)
class BenchArgs:
    model: str = "small"
    tiny: bool = False
    device: str = "cuda"
    tensor_parallel_size: int = 2
    expert_parallel: bool = False
    batches: tuple[int, ...] = (1, 8, 64, 256)
    contexts: tuple[int, ...] = (8192, 32768)
    reps: int = 30
    seed: int = 0


def run_rank(rank: int, args: BenchArgs, init: str, out_path: str | None) -> list[dict]:
    """One rank of the benchmark (every rank makes the same calls in the same order: the collectives pair up).
    Rank 0 prints the table and, with `out_path`, writes the rows as JSON."""
    size = args.tensor_parallel_size
    cuda = args.device.startswith("cuda")
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=size)
    try:
        return _bench(rank, args, device, out_path)
    finally:
        dist.destroy_process_group()


def _bench(rank: int, args: BenchArgs, device: str, out_path: str | None) -> list[dict]:
    cuda = device.startswith("cuda")
    say = print if rank == 0 else (lambda *a, **k: None)
    if cuda:  # NCCL communicators start lazily: make it before any graph captures a collective
        dist.all_reduce(torch.zeros(1, device=device))
        torch.cuda.synchronize(device)
    ceil = (measure_ceilings() if cuda else host_ceilings()) if rank == 0 else None
    config = model_config(args.model, args.tiny)
    plan = plan_rank(config, args.tensor_parallel_size, rank, args.expert_parallel, nvfp4_layers(config))
    model = random_rank_model(config, plan, None, device, args.seed)
    replicated = check_replicated(model, plan)
    name = "tiny" if args.tiny else args.model
    mode = "expert parallel" if args.expert_parallel else "tensor parallel"
    weights_gb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 1e9
    if rank == 0:
        print(ceil.line(), flush=True)
    say(
        f"# {name}: {config.text.num_layers} layers, {mode} over {args.tensor_parallel_size} ranks, "
        f"{weights_gb:.1f} GB of weights on rank 0, {replicated} replicated tensors equal on every rank",
        flush=True,
    )
    layers = config.text.num_layers
    rows = []
    max_model_len = max(args.contexts) + 1
    for ctx in args.contexts:
        for b in args.batches:
            free = torch.cuda.mem_get_info(device)[0] if cuda else float("inf")
            fits = _max_over_ranks(float(kv_bytes(model, b, ctx) * 1.1 + (4 << 30) > free), None) == 0.0
            if not fits:
                say(f"# ctx={ctx} B={b}: skipped (its KV pools do not fit next to the weights)", flush=True)
                continue
            fb, graphs, handles = paged_decode_batch(model, b, ctx, max_model_len, device, seed=args.seed + b)
            tokens = fb.token_ids.tolist()
            eager = DecodeGraphs(model, graphs.cache, max_num_seqs=b, max_model_len=max_model_len, use_graphs=False)

            def step(runner, tokens=tokens, handles=handles, fb=fb):
                with torch.inference_mode():
                    if runner is None:  # the packed path (the CPU's reference ops have no paged decode step)
                        return model.logits(model(fb))
                    return model.logits(runner.run(tokens, handles))

            if not cuda:
                eager = graphs = None
            vocab = plan.sample_vocab
            same = None
            if cuda:
                same = torch.equal(step(graphs)[:, :vocab].argmax(-1), step(eager)[:, :vocab].argmax(-1))
                same = _max_over_ranks(float(not same), None) == 0.0
            else:
                step(eager)
            touched = touched_experts(model, fb)
            per_gpu = _max_over_ranks(step_bytes(model, b, ctx, touched), None)
            reduce_ms = all_reduce_ms((b, config.text.hidden_size), None, device)
            eager_ms = time_ms(partial(step, eager), device, reps=max(3, args.reps // 10), warmup=1)
            graphs_ms = time_ms(partial(step, graphs), device, reps=args.reps, warmup=3) if cuda else None

            if rank == 0:
                bytes_ms = ceil.floor_us(per_gpu) / 1e3
                floor = bytes_ms + 2 * layers * reduce_ms
                best = graphs_ms if graphs_ms is not None else eager_ms
                row = {
                    "ctx": ctx,
                    "batch": b,
                    "experts": "/".join(str(touched[i]) for i in sorted(touched)),
                    "gb_per_gpu": per_gpu / 1e9,
                    "bytes_ms": bytes_ms,
                    "message_kb": b * config.text.hidden_size * 2 / 1024,
                    "all_reduce_us": reduce_ms * 1e3,
                    "floor_ms": floor,
                    "eager_ms": eager_ms,
                    "graphs_ms": graphs_ms,
                    "ratio": best / floor,
                    "tokens_equal": same,
                }
                rows.append(row)
                say(f"# {json.dumps(row)}", flush=True)
            del fb, graphs, eager, handles
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    if rank == 0:
        _print_table(rows, ceil, name, mode, args, layers)
        if out_path:
            with open(out_path, "w") as f:
                json.dump(rows, f)
    return rows


def _print_table(rows: list[dict], ceil: Ceilings, name: str, mode: str, args: BenchArgs, layers: int) -> None:
    print()
    print(ceil.line())
    print(f"# {name} decode step, {mode}, {args.tensor_parallel_size} ranks; floor = per-GPU bytes / copy bandwidth "
          f"+ 2 x {layers} layers x all-reduce latency; ratio = graphs (eager on cpu) / floor")  # fmt: skip
    print(
        "| ctx | B | experts touched (rank 0) | GB / GPU | bytes ms | all-reduce us (KB) | floor ms | eager ms |"
        " graphs ms | ratio | eager == graphs tokens |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        graphs = "-" if r["graphs_ms"] is None else f"{r['graphs_ms']:.2f}"
        same = "-" if r["tokens_equal"] is None else ("yes" if r["tokens_equal"] else "NO")
        print(
            f"| {r['ctx']} | {r['batch']} | {r['experts']} | {r['gb_per_gpu']:.2f} | {r['bytes_ms']:.2f} | "
            f"{r['all_reduce_us']:.1f} ({r['message_kb']:.0f}) | {r['floor_ms']:.2f} | {r['eager_ms']:.2f} | "
            f"{graphs} | {r['ratio']:.2f}x | {same} |"
        )


def launch(args: BenchArgs, out_path: str | None = None) -> None:
    """Start the N ranks as processes (spawn) and wait for them."""
    if args.device.startswith("cuda") and torch.cuda.device_count() < args.tensor_parallel_size:
        raise SystemExit(
            f"--tensor-parallel-size {args.tensor_parallel_size} needs as many GPUs; "
            f"{torch.cuda.device_count()} are visible"
        )
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        mp.start_processes(
            run_rank, args=(args, init, out_path), nprocs=args.tensor_parallel_size, join=True, start_method="spawn"
        )


def add_args(parser: argparse.ArgumentParser) -> None:
    """The tensor-parallel flags of `bench_decode`."""
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks (GPUs); > 1 runs this benchmark")
    parser.add_argument("--enable-expert-parallel", action="store_true")
    parser.add_argument("--model", choices=sorted(MODELS), default="small", help="full-depth shapes under TP")
    parser.add_argument("--tiny", action="store_true", help="make-tiny shapes (CPU smoke runs)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--json", default=None, help="also write the rows here (tensor parallel runs)")


def from_namespace(ns: argparse.Namespace, default_batches: list[int], default_contexts: list[int]) -> BenchArgs:
    """`BenchArgs` of a parsed `bench_decode` command line; B 1/8/64/256 at ctx 8k/32k unless given."""
    if ns.tensor_parallel_size < 1:
        raise SystemExit(f"--tensor-parallel-size must be >= 1, got {ns.tensor_parallel_size}")
    if ns.enable_expert_parallel and ns.tensor_parallel_size == 1:
        raise SystemExit("--enable-expert-parallel needs --tensor-parallel-size > 1")
    batches = ns.batches if ns.batches != default_batches else [1, 8, 64, 256]
    contexts = ns.contexts if ns.contexts != default_contexts else [8192, 32768]
    return BenchArgs(
        model=ns.model,
        tiny=ns.tiny,
        device=ns.device,
        tensor_parallel_size=ns.tensor_parallel_size,
        expert_parallel=ns.enable_expert_parallel,
        batches=tuple(batches),
        contexts=tuple(contexts),
    )
