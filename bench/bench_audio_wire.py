"""Audio on the wire: bytes per audio second as bf16 tower rows (before) vs dMel codes (after), and what the
codebook sum costs the decode replica that now does it.

For Inkling-Small audio (dMel 80 x 16, D=4096; random tower weights) and WAV clips made here (44.1 kHz stereo,
tones + noise), one audio item is encoded both ways and measured as it travels: the serialized `EncodeChunk`
messages of one `Encode` stream item plus gRPC's 5-byte message prefix each, and the Redis embedding-cache value
(`common.cache_store`). The codebook sum runs on --device in --dtype (the encoder tower's dtype); its rows are
checked bit-identical to the tower's before they are timed.

    python -m bench.bench_audio_wire [--seconds 1,10,60] [--device cuda --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import torch

from bench.bench_encoder import SMALL_AUDIO, make_wav, median_s
from common.cache_store import Entry, serialize_entry
from common.config import AudioConfig
from common.dtypes import torch_dtype
from common.wire import (
    DTYPE_UINT8,
    KIND_DMEL_CODES,
    EncodedItem,
    Span,
    codes_to_bytes,
    item_messages,
)
from encoder_service.codebook import AudioCodebook
from encoder_service.preprocess.audio import AudioPolicy, preprocess_audio
from encoder_service.service import bf16_bits
from encoder_service.towers import AudioTower, build_audio_tower

GRPC_PREFIX_BYTES = 5  # per message: compressed flag + u32 length
WAV_RATE = 44100


@dataclasses.dataclass(frozen=True)
class WireBytes:
    stream: int  # Encode stream bytes of the item (messages + gRPC prefixes)
    cache: int  # Redis value bytes


def wire_bytes(item: EncodedItem) -> WireBytes:
    stream = sum(m.ByteSize() + GRPC_PREFIX_BYTES for m in item_messages(item))
    entry = Entry(
        item.modality,
        item.rows,
        item.dim,
        item.payload,
        item.spans,
        item.dtype,
        item.kind,
        item.codes_per_row,
        item.tower_dtype,
    )
    return WireBytes(stream, len(serialize_entry(entry)))


def both_items(codes: np.ndarray, encoder_tower: AudioTower, dtype: str) -> tuple[EncodedItem, EncodedItem]:
    """(rows item as the encoder sent it before: its tower's output, codes item as it sends it now)."""
    frames = len(codes)
    codes_item = EncodedItem(
        item_index=0,
        mm_key=bytes(32),
        modality="audio",
        rows=frames,
        dim=encoder_tower.config.output_dim,
        payload=codes_to_bytes(codes),
        spans=(Span("audio", frames),),
        dtype=DTYPE_UINT8,
        kind=KIND_DMEL_CODES,
        codes_per_row=codes.shape[1],
        tower_dtype=dtype,
    )
    with torch.inference_mode():
        device = encoder_tower.encoder.weight.device
        rows = bf16_bits(encoder_tower(torch.from_numpy(codes).to(device)))
    rows_item = EncodedItem(
        item_index=0,
        mm_key=bytes(32),
        modality="audio",
        rows=frames,
        dim=encoder_tower.config.output_dim,
        payload=rows.astype("<u2").tobytes(),
        spans=(Span("audio", frames),),
    )
    return rows_item, codes_item


def random_audio_state(config: AudioConfig, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Checkpoint-like bf16 audio tower weights."""
    generator = torch.Generator().manual_seed(seed)
    rows = config.n_mel_bins * config.mel_vocab_size
    state = {
        "encoder.weight": torch.randn(rows, config.output_dim, generator=generator) * 0.02,
        "final_norm.weight": 1.0 + 0.1 * torch.randn(config.output_dim, generator=generator),
    }
    return {k: v.to(device=device, dtype=torch.bfloat16) for k, v in state.items()}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", default="1,10,60", help="clip lengths, comma-separated")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    state = random_audio_state(SMALL_AUDIO, args.device)
    encoder_tower = build_audio_tower(SMALL_AUDIO, state, device, torch_dtype(args.dtype))  # the encoder's
    codebook = AudioCodebook(SMALL_AUDIO, state, device)  # the decode replica's
    policy = AudioPolicy()
    print(
        f"audio item on the wire, Inkling-Small (D={SMALL_AUDIO.output_dim}, {SMALL_AUDIO.n_mel_bins} mel bins), "
        f"tower {args.dtype} on {device}"
    )
    header = (
        f"{'clip s':>7} {'frames':>7} | {'rows B/s':>10} {'codes B/s':>10} {'ratio':>7} | "
        f"{'cache rows B/s':>14} {'cache codes B/s':>15} | {'sum ms/audio s':>14}"
    )
    print(header)
    results = []
    for seconds in (float(s) for s in args.seconds.split(",")):
        codes = preprocess_audio(make_wav(seconds, WAV_RATE), policy)  # [F, 80] uint8
        rows_item, codes_item = both_items(codes, encoder_tower, args.dtype)
        summed = codebook.rows(codes_item, "bench audio")
        assert np.array_equal(bf16_bits(summed), np.frombuffer(rows_item.payload, "<u2").reshape(len(codes), -1))
        before, after = wire_bytes(rows_item), wire_bytes(codes_item)
        sum_s = median_s(lambda item=codes_item: codebook.rows(item, "bench audio"), args.reps, device=device)
        row = {
            "seconds": seconds,
            "frames": len(codes),
            "rows_bytes_per_s": before.stream / seconds,
            "codes_bytes_per_s": after.stream / seconds,
            "cache_rows_bytes_per_s": before.cache / seconds,
            "cache_codes_bytes_per_s": after.cache / seconds,
            "sum_ms_per_audio_s": 1e3 * sum_s / seconds,
        }
        results.append(row)
        print(
            f"{seconds:>7.1f} {len(codes):>7} | {row['rows_bytes_per_s']:>10.0f} {row['codes_bytes_per_s']:>10.0f} "
            f"{row['rows_bytes_per_s'] / row['codes_bytes_per_s']:>6.1f}x | "
            f"{row['cache_rows_bytes_per_s']:>14.0f} {row['cache_codes_bytes_per_s']:>15.0f} | "
            f"{row['sum_ms_per_audio_s']:>14.3f}"
        )
    return results


if __name__ == "__main__":
    main()
