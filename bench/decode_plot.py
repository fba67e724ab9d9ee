"""The decode benchmark's PNG: step time / byte floor against batch (one line per context) and prefill tokens/s
against chunk size. Needs matplotlib (the `test` extra); drawn with the Agg backend, no display."""

from __future__ import annotations

from pathlib import Path


def write_plot(
    path: str | Path,
    ratios: dict[int, list[tuple[int, float]]],
    prefill: list[tuple[int, float]],
    prefill_tokens: int,
    title: str,
) -> None:
    """`ratios`: {ctx: [(B, step / floor)]}; `prefill`: [(chunk, tokens/s)] of one `prefill_tokens`-token prompt."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for ctx, points in sorted(ratios.items()):
        batches, values = zip(*sorted(points), strict=True)
        left.plot(batches, values, marker="o", label=f"ctx {ctx}")
    left.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="byte floor")
    left.set_xscale("log", base=2)
    batches = sorted({b for points in ratios.values() for b, _ in points})
    left.set_xticks(batches, [str(b) for b in batches])
    left.set_xlabel("batch (sequences)")
    left.set_ylabel("graphs step / byte floor")
    left.set_title("decode step vs floor")
    left.legend()
    left.grid(True, alpha=0.3)
    if prefill:
        chunks, rates = zip(*sorted(prefill), strict=True)
        right.plot(chunks, rates, marker="o")
        right.set_xscale("log", base=2)
        right.set_xticks(chunks, [str(c) for c in chunks])
    right.set_xlabel("prefill chunk (tokens)")
    right.set_ylabel("tokens/s")
    right.set_title(f"prefill of one {prefill_tokens}-token prompt")
    right.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
