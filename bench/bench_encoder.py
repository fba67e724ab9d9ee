"""Encoder replica benchmark: patches/s and audio-seconds/s per stage (decode+resize, patchify+normalize, tower)
for Inkling-Small tower shapes (P=40, T=2, L=4, D=4096; dMel 80x16) with random weights, against the tower's
FLOP floor (spec multimodal 8.1: 0.19 GFLOP/patch) at a bf16 (CUDA) or CPU matmul peak measured in the same run.

Inputs are generated here: 640x480 and 1024x768 JPEGs (default f=2.0 / 2048 rescale policy) and 10 s of
44.1 kHz stereo WAV. Preprocessing always runs on the CPU, one thread per item (the engine's thread pool runs
items in parallel; the all-core line shows that). The tower runs on --device. Parts whose packages are missing
(PIL for images; PyAV + librosa for audio) are skipped and named in the output.

    python -m bench.bench_encoder [--quick] [--device cuda --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import time
import wave
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType

import numpy as np
import torch

from common.config import AudioConfig, VisionConfig
from encoder_service.towers import AudioTower, VisionTower

SPEC_FLOP_PER_PATCH = 189_890_560  # spec 8.1: both frames through every layer
SMALL_VISION = VisionConfig(
    patch_size=40, temporal_patch_size=2, num_channels=3, num_layers=4, output_dim=4096, use_norm=True
)
SMALL_AUDIO = AudioConfig(
    n_mel_bins=80, mel_vocab_size=16, dmel_min_value=-7.0, dmel_max_value=2.0, output_dim=4096, use_norm=True
)
IMAGE_SIZES = ((640, 480), (1024, 768))
TOWER_BATCHES = (256, 2048, 8192)
AUDIO_SECONDS, AUDIO_RATE = 10.0, 44100
AUDIO_BATCH_FRAMES = 8192


# ---------------------------------------------------------------------------------------------------------
# Optional preprocessing modules


def _image_module() -> ModuleType | None:
    """`encoder_service.preprocess.image` (needs PIL and numpy), or None where PIL is missing."""
    try:
        from encoder_service.preprocess import image
    except ImportError:
        return None
    return image


def _audio_module() -> ModuleType | None:
    try:
        from encoder_service.preprocess import audio

        return audio
    except ImportError:
        return None


# ---------------------------------------------------------------------------------------------------------
# Inputs


def make_jpeg(width: int, height: int, seed: int = 0) -> bytes:
    """Photo-like content (smooth gradients + texture), quality 90."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1) * 200.0
    texture = rng.normal(0.0, 20.0, (height, width, 3)).astype(np.float32)
    pixels = np.clip(base + texture + 28.0 * np.sin(x / 17.0)[..., None], 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def make_wav(seconds: float, rate: int, seed: int = 0) -> bytes:
    """Stereo 16-bit PCM: two tone sets plus noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    left = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(t.size)
    right = 0.2 * np.sin(2 * np.pi * 1375 * t) + 0.05 * rng.standard_normal(t.size)
    pcm = (np.stack([left, right], axis=1) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------------------
# Timing


def median_s(fn: Callable[[], object], reps: int, warmup: int = 1, device: torch.device | None = None) -> float:
    """Median wall time of `fn` (synchronising CUDA around each call)."""
    cuda = device is not None and device.type == "cuda"
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_peak_tflops(device: torch.device, dtype: torch.dtype, quick: bool) -> float:
    """Large square matmul rate in `dtype` (CUDA: bench.floors' 8192^3 bf16 measurement)."""
    if device.type == "cuda":
        from bench.floors import measure_ceilings

        ceilings = measure_ceilings()
        print(ceilings.line())
        return ceilings.bf16_tflops
    n = 1024 if quick else 2048
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / median_s(lambda: a @ b, reps=3) / 1e12


def executed_flop_per_patch(tower: VisionTower) -> int:
    """FLOPs the tower really runs for a still image: layers before the temporal fold see one frame."""
    cfg, total, frames = tower.config, 0, 1
    for i, ((t_fold, hw_fold), (a, b)) in enumerate(
        zip(tower.folds, zip(tower.plan[:-1], tower.plan[1:], strict=True), strict=True)
    ):
        if t_fold > 1:
            frames = cfg.temporal_patch_size
        width_in = a.c * t_fold * hw_fold * hw_fold
        width_out = cfg.output_dim if i == len(tower.folds) - 1 else b.c
        positions = (frames // b.t) * (cfg.patch_size // b.h) ** 2
        total += 2 * width_in * width_out * positions
    return total


def fmt(value: float, digits: int = 1) -> str:
    if value >= 1e6:
        return f"{value / 1e6:.2f}M"
    if value >= 1e4:
        return f"{value / 1e3:.0f}k"
    return f"{value:.{digits}f}"


def table(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" for _ in header) + "|")
    for cells in rows:
        print("| " + " | ".join(cells) + " |")
    print()


# ---------------------------------------------------------------------------------------------------------
# Benchmarks


def bench_vision_tower(
    device: torch.device, dtype: torch.dtype, batches: tuple[int, ...], peak: float, reps: int
) -> dict[int, float]:
    """Tower time per batch; returns patches/s per batch size."""
    torch.manual_seed(0)
    with torch.device(device):
        tower = VisionTower(SMALL_VISION)
    tower = tower.to(dtype).eval().requires_grad_(False)
    executed = executed_flop_per_patch(tower)
    rates: dict[int, float] = {}
    rows = []
    for batch in batches:
        host = torch.randn(batch, 40, 40, 3)
        pixels = host.to(device)
        with torch.inference_mode():
            seconds = median_s(lambda x=pixels: tower(x), reps, device=device)
            copy_s = float("nan")
            if device.type == "cuda":  # the engine's path: float32 patches in, bf16 rows back to the host
                copy_s = median_s(lambda x=host: tower(x.to(device)).to(torch.bfloat16).cpu(), reps, device=device)
        rates[batch] = batch / seconds
        floor_s = batch * SPEC_FLOP_PER_PATCH / (peak * 1e12)
        rows.append(
            [
                str(batch),
                f"{seconds * 1e3:.2f}",
                fmt(batch / seconds),
                f"{batch * SPEC_FLOP_PER_PATCH / seconds / 1e12:.3f}",
                f"{floor_s * 1e3:.3f}",
                f"{seconds / floor_s:.2f}",
                f"{100 * batch * executed / seconds / 1e12 / peak:.0f}%",
                "-" if copy_s != copy_s else f"{copy_s * 1e3:.2f}",
            ]
        )
    print(f"## Vision tower (hMLP, Inkling-Small shapes, random weights, {dtype}, {device.type})\n")
    print(
        f"spec FLOPs {SPEC_FLOP_PER_PATCH / 1e9:.3f} GFLOP/patch (T=2 through every layer); executed "
        f"{executed / 1e9:.3f} GFLOP/patch (layers before the temporal fold run one frame); floor = spec FLOPs "
        f"/ measured matmul peak {peak:.2f} TFLOP/s\n"
    )
    table(
        [
            "batch (patches)",
            "ms",
            "patches/s",
            "TFLOP/s (spec FLOPs)",
            "floor ms",
            "measured/floor",
            "executed FLOPs % of peak",
            "ms incl. H2D+D2H",
        ],
        rows,
    )
    return rates


def bench_images(pp: ModuleType, tower_rates: dict[int, float], reps: int) -> None:
    policy = pp.ImagePolicy()  # patch 40, f=2.0, cap 2048
    tower_batch = max(tower_rates)
    tower_rate = tower_rates[tower_batch]
    workers = os.cpu_count() or 1
    rows, parallel = [], []
    for width, height in IMAGE_SIZES:
        data = make_jpeg(width, height)

        def decode_resize(data: bytes = data) -> np.ndarray:
            rgb = pp.to_rgb(pp.decode_image(data, policy))
            size = pp.rescaled_size(*rgb.size, policy)
            if size != rgb.size:
                rgb = rgb.resize(size, pp.Image.Resampling.LANCZOS)
            return np.asarray(rgb, dtype=np.uint8)

        rgb = decode_resize()
        patches = pp.patchify(rgb, policy.patch_size)[0].shape[0]
        assert patches == pp.image_token_count(width, height, policy)
        t_decode = median_s(decode_resize, reps)
        t_patch = median_s(lambda rgb=rgb: pp.patchify(rgb, policy.patch_size), reps)
        t_tower = patches / tower_rate
        total = t_decode + t_patch + t_tower
        rows.append(
            [
                f"{width}x{height} -> {rgb.shape[1]}x{rgb.shape[0]}",
                str(patches),
                f"{t_decode * 1e3:.1f}",
                f"{t_patch * 1e3:.1f}",
                f"{t_tower * 1e3:.2f}",
                f"{total * 1e3:.1f}",
                fmt(patches / t_decode),
                fmt(patches / t_patch),
                fmt(tower_rate),
                fmt(patches / total),
            ]
        )
        n_items = 2 * workers
        with ThreadPoolExecutor(workers) as pool:

            def run_all(data: bytes = data, n_items: int = n_items) -> None:
                list(pool.map(lambda d: pp.preprocess_image(d, policy), [data] * n_items))

            t_all = median_s(run_all, max(1, reps // 2))
        parallel.append(
            [
                f"{width}x{height}",
                str(workers),
                fmt(n_items * patches / t_all),
                fmt(min(n_items * patches / t_all, tower_rate)),
            ]
        )
    print(
        f"## Images per replica (JPEG, f=2.0 cap 2048; preprocessing 1 CPU thread per item; tower at its "
        f"batch-{tower_batch} rate)\n"
    )
    table(
        [
            "image",
            "patches",
            "decode+resize ms",
            "patchify+norm ms",
            "tower ms",
            "total ms",
            "decode+resize p/s",
            "patchify+norm p/s",
            "tower p/s",
            "total p/s (serial)",
        ],
        rows,
    )
    print("All-core preprocessing (decode+resize+patchify, thread pool) and the replica's pipeline bound:\n")
    table(["image", "threads", "preprocess p/s", "replica p/s = min(preprocess, tower)"], parallel)


def bench_audio(pp: ModuleType | None, device: torch.device, dtype: torch.dtype, reps: int) -> list[str]:
    torch.manual_seed(0)
    with torch.device(device):
        tower = AudioTower(SMALL_AUDIO)
    tower = tower.to(dtype).eval().requires_grad_(False)
    skipped = []
    rows = []
    frames = int(AUDIO_SECONDS * 20)
    if pp is not None:
        policy = pp.AudioPolicy()
        data = make_wav(AUDIO_SECONDS, AUDIO_RATE)

        def decode_resample() -> np.ndarray:
            samples, rate = pp.decode_audio(data, policy)
            return pp.to_mono_16k(samples, rate, policy)

        mono = decode_resample()
        t_decode = median_s(decode_resample, reps)
        t_feat = median_s(lambda: pp.quantize_dmel(pp.log_mel(mono, policy), policy), reps)
        codes = torch.from_numpy(pp.quantize_dmel(pp.log_mel(mono, policy), policy))
        frames = codes.shape[0]
        rows.append(
            ["decode + mono + resample to 16 kHz (soxr_hq)", f"{t_decode * 1e3:.2f}", fmt(AUDIO_SECONDS / t_decode)]
        )
        rows.append(["STFT + log-mel + dMel", f"{t_feat * 1e3:.2f}", fmt(AUDIO_SECONDS / t_feat)])
    else:
        skipped.append("audio decode/resample/dMel (PyAV or librosa missing): tower on random codes")
        codes = torch.randint(0, 16, (frames, 80), dtype=torch.uint8)
        t_decode = t_feat = 0.0
    with torch.inference_mode():
        clip = codes.to(device)
        t_tower = median_s(lambda: tower(clip), reps, device=device)
        big = torch.randint(0, 16, (AUDIO_BATCH_FRAMES, 80), dtype=torch.uint8, device=device)
        t_big = median_s(lambda: tower(big), reps, device=device)
    rows.append([f"tower, one clip ({frames} frames)", f"{t_tower * 1e3:.2f}", fmt(AUDIO_SECONDS / t_tower)])
    big_seconds = AUDIO_BATCH_FRAMES / 20
    rows.append(
        [
            f"tower, batch of {AUDIO_BATCH_FRAMES} frames ({big_seconds:.0f} s)",
            f"{t_big * 1e3:.2f}",
            fmt(big_seconds / t_big),
        ]
    )
    total = t_decode + t_feat + t_tower
    label = "total (serial, one clip)" if pp is not None else "total (tower only: preprocessing skipped)"
    rows.append([label, f"{total * 1e3:.2f}", fmt(AUDIO_SECONDS / total)])
    print(
        f"## Audio per replica ({AUDIO_SECONDS:.0f} s of {AUDIO_RATE / 1000:.1f} kHz stereo WAV; dMel tower "
        f"{dtype}, {device.type}; 1 CPU thread)\n"
    )
    table(["stage", f"ms per {AUDIO_SECONDS:.0f} s clip", "audio-s/s"], rows)
    return skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="tower device: cpu or cuda")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="tower dtype (default: bfloat16 on CUDA, float32 on CPU)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer repetitions; CPU: tower batch 256 only")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    reps = 3 if args.quick else 7
    batches = TOWER_BATCHES
    if device.type == "cpu":
        reps = 2 if args.quick else 3
        batches = TOWER_BATCHES[:1] if args.quick else TOWER_BATCHES
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU x{torch.get_num_threads()} threads"
    print(f"# bench_encoder: {name}, tower {dtype}, torch {torch.__version__}, {os.cpu_count()} CPU cores\n")
    started = time.perf_counter()
    peak = matmul_peak_tflops(device, dtype, args.quick)
    print(f"# matmul peak ({dtype}, {device.type}): {peak:.3f} TFLOP/s\n")
    rates = bench_vision_tower(device, dtype, batches, peak, reps)
    skipped = []
    image_pp = _image_module()
    if image_pp is not None:
        bench_images(image_pp, rates, reps)
    else:
        skipped.append("image decode/resize/patchify (PIL missing)")
    skipped += bench_audio(_audio_module(), device, dtype, reps)
    print(f"skipped: {'; '.join(skipped) if skipped else 'nothing'}")
    print(f"wall time {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
