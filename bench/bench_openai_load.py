"""Load test of the OpenAI-compatible front with NVIDIA's `aiperf`: streaming chat at several concurrency levels.

    python -m bench.bench_openai_load --url http://127.0.0.1:8000 --concurrency 1,2,4,8
    python -m bench.bench_openai_load --checkpoint artifacts/tiny --concurrency 1,2,4   # starts a local cluster

aiperf pins packages of its own (an older prometheus-client, pillow, ...), so it runs from its own virtual
environment, found as `--aiperf PATH`, else `.venv-aiperf/bin/aiperf`, else `aiperf` on PATH:

    python3 -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf==0.13.0

Each level is one `aiperf profile` run (synthetic prompts of --input-tokens, --output-tokens with ignore_eos,
server-reported token counts, `--tokenizer builtin`: tiktoken o200k_base, which is Inkling's vocabulary; its
file is taken from the tml-renderers wheel so nothing is downloaded). The report (report.md, report.json and
ttft_itl_vs_concurrency.png under --out) gives TTFT and inter-token latency percentiles per level; the
"floor" column is the concurrency-1 level (unloaded), and the ratio shows what load costs.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PERCENTILES = ("p50", "p90", "p99")
_O200K_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"


@dataclass(frozen=True)
class Level:
    concurrency: int
    requests: int
    completed: int
    errors: int
    request_throughput: float  # requests/s
    output_token_throughput: float  # tokens/s
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    output_tokens_avg: float


def find_aiperf(explicit: str | None = None) -> str | None:
    """The aiperf executable: `explicit`, else the repo's .venv-aiperf, else PATH."""
    if explicit:
        return explicit if Path(explicit).is_file() else None
    local = REPO_ROOT / ".venv-aiperf" / "bin" / "aiperf"
    return str(local) if local.is_file() else shutil.which("aiperf")


def tiktoken_cache(directory: Path) -> Path:
    """A TIKTOKEN_CACHE_DIR holding o200k_base from the tml-renderers wheel (located without importing it:
    its package imports torch), under the name tiktoken looks up."""
    spec = importlib.util.find_spec("tml_renderers")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("tml-renderers is not installed: it ships the o200k_base vocabulary aiperf counts with")
    source = Path(next(iter(spec.submodule_search_locations))) / "data" / "o200k_base.tiktoken"
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, directory / hashlib.sha1(_O200K_URL.encode()).hexdigest())
    return directory


def served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as response:
        return json.load(response)["data"][0]["id"]


def _metric(summary: dict, name: str) -> dict:
    return summary.get(name) or {}


def run_level(
    aiperf: str,
    url: str,
    model: str,
    concurrency: int,
    requests: int,
    input_tokens: int,
    output_tokens: int,
    out: Path,
    timeout_s: float,
) -> Level:
    artifacts = out / f"concurrency-{concurrency}"
    shutil.rmtree(artifacts, ignore_errors=True)
    argv = [
        aiperf, "profile",
        "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
        "--tokenizer", "builtin", "--use-server-token-count",
        "--concurrency", str(concurrency), "--request-count", str(requests),
        "--synthetic-input-tokens-mean", str(input_tokens), "--synthetic-input-tokens-stddev", "0",
        "--output-tokens-mean", str(output_tokens), "--output-tokens-stddev", "0",
        "--extra-inputs", "ignore_eos:true", "--random-seed", "0",
        "--artifact-dir", str(artifacts), "--ui-type", "none",
    ]  # fmt: skip
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": str(tiktoken_cache(out / "tiktoken-cache"))}
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=out)
    (out / f"aiperf-concurrency-{concurrency}.log").write_text(result.stdout + result.stderr)
    summary_path = artifacts / "profile_export_aiperf.json"
    if result.returncode != 0 or not summary_path.exists():
        raise RuntimeError(
            f"aiperf failed at concurrency {concurrency} (exit {result.returncode}):\n{result.stderr[-3000:]}"
        )
    summary = json.loads(summary_path.read_text())
    completed = int(_metric(summary, "request_count").get("avg", 0))
    errors = int(_metric(summary, "error_request_count").get("avg", 0))
    return Level(
        concurrency=concurrency,
        requests=requests,
        completed=completed,
        errors=errors,
        request_throughput=float(_metric(summary, "request_throughput").get("avg", 0.0)),
        output_token_throughput=float(_metric(summary, "output_token_throughput").get("avg", 0.0)),
        ttft_ms={p: float(_metric(summary, "time_to_first_token")[p]) for p in PERCENTILES},
        itl_ms={p: float(_metric(summary, "inter_token_latency")[p]) for p in PERCENTILES},
        output_tokens_avg=float(_metric(summary, "output_sequence_length").get("avg", 0.0)),
    )


def format_table(levels: Sequence[Level]) -> str:
    floor = levels[0]
    header = (
        f"{'conc':>4} {'done':>5} {'err':>4} {'req/s':>7} {'tok/s':>8} "
        + " ".join(f"{'ttft ' + p:>10}" for p in PERCENTILES)
        + " "
        + " ".join(f"{'itl ' + p:>9}" for p in PERCENTILES)
        + f" {'ttft p50/floor':>15} {'itl p50/floor':>14}"
    )
    rows = [header, f"(ms; floor = concurrency {floor.concurrency}, unloaded)"]
    for lv in levels:
        rows.append(
            f"{lv.concurrency:>4} {lv.completed:>5} {lv.errors:>4} {lv.request_throughput:>7.2f} "
            f"{lv.output_token_throughput:>8.1f} "
            + " ".join(f"{lv.ttft_ms[p]:>10.1f}" for p in PERCENTILES)
            + " "
            + " ".join(f"{lv.itl_ms[p]:>9.2f}" for p in PERCENTILES)
            + f" {lv.ttft_ms['p50'] / floor.ttft_ms['p50']:>15.2f} {lv.itl_ms['p50'] / floor.itl_ms['p50']:>14.2f}"
        )
    return "\n".join(rows)


def plot(levels: Sequence[Level], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [lv.concurrency for lv in levels]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in ((axes[0], "ttft_ms", "time to first token"), (axes[1], "itl_ms", "inter-token latency")):
        for p, style in zip(PERCENTILES, ("o-", "s--", "^:"), strict=True):
            ax.plot(x, [getattr(lv, key)[p] for lv in levels], style, label=p)
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(c) for c in x])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("OpenAI front under aiperf load (streaming chat)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(levels: Sequence[Level], out: Path, context: dict) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "markdown": out / "report.md", "plot": out / "ttft_itl_vs_concurrency.png"}
    paths["json"].write_text(json.dumps({"context": context, "levels": [asdict(lv) for lv in levels]}, indent=2))
    plot(levels, paths["plot"])
    lines = [
        "# OpenAI front load test (aiperf)",
        "",
        ", ".join(f"{k}: {v}" for k, v in context.items()),
        "",
        "```",
        format_table(levels),
        "```",
        "",
        f"![TTFT and ITL vs concurrency]({paths['plot'].name})",
        "",
    ]
    paths["markdown"].write_text("\n".join(lines))
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_openai_load", description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="base URL of a running front, e.g. http://127.0.0.1:8000")
    target.add_argument("--checkpoint", help="start a local cluster with the front (deploy.launch.Cluster)")
    parser.add_argument("--encoders", type=int, default=1)
    parser.add_argument("--decoders", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None, help="model id (default: what /v1/models lists)")
    parser.add_argument("--concurrency", default="1,2,4", help="levels, comma-separated (the first is the floor)")
    parser.add_argument("--requests-per-stream", type=int, default=4, help="requests per level = this x concurrency")
    parser.add_argument("--input-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--aiperf", default=None, help="path of the aiperf executable")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="cap per level")
    parser.add_argument("--out", default="artifacts/openai-load", help="report directory")
    args = parser.parse_args(argv)
    levels_wanted = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not levels_wanted or min(levels_wanted) < 1:
        raise SystemExit("--concurrency: comma-separated integers >= 1")
    aiperf = find_aiperf(args.aiperf)
    if aiperf is None:
        raise SystemExit(
            "aiperf not found: python3 -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf==0.13.0"
        )
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        url = args.url
        if args.checkpoint:
            from deploy.launch import Cluster, ClusterSpec

            spec = ClusterSpec(
                checkpoint=args.checkpoint,
                encoders=args.encoders,
                decoders=args.decoders,
                redis="none",
                device=args.device,
                dtype=args.dtype,
                api_port=0,
            )
            cluster = stack.enter_context(Cluster(spec))
            url = f"http://{cluster.api.address}"
            print(f"local cluster: api {url}, router {cluster.router_address}, logs {cluster.log_dir}", flush=True)
        model = args.model or served_model(url)
        levels = [
            run_level(
                aiperf, url, model, c, args.requests_per_stream * c, args.input_tokens, args.output_tokens, out,
                args.timeout_s,
            )
            for c in levels_wanted
        ]  # fmt: skip
    context = {"url": url, "model": model, "input_tokens": args.input_tokens, "output_tokens": args.output_tokens}
    paths = write_report(levels, out, context)
    print(format_table(levels))
    print(f"report: {paths['markdown']} (plot {paths['plot']})")
    return 1 if any(lv.errors or lv.completed != lv.requests for lv in levels) else 0


if __name__ == "__main__":
    sys.exit(main())
