"""Registers, spills and ptxas performance warnings of the Triton kernels compiled for CUDA on this machine.

Reads a Triton cache (``--cache``, else Triton's own, ``triton.knobs.cache.dir``): every compiled kernel's PTX
and its metadata. Each PTX is assembled again (``-v``, for the ``.target`` it names) by the ptxas Triton itself uses
for that target. One line is printed per distinct kernel build: name, warps, stages, shared memory, registers and
spilled bytes, then any "Potential Performance Loss" note of ptxas (C7515: every wgmma of the kernel serialised; it
cost the NVFP4 prefill tiles ~6%, docs/decisions.md 2026-12-04). Run it on the GPU machine after a benchmark, with
the benchmark's cache, to cover what that benchmark ran. PTX compiled elsewhere works too (``triton.compile`` with a
``GPUTarget`` needs no GPU), which is how that note was found.

    TRITON_CACHE_DIR=/tmp/tc python3 -m bench.bench_decode ...
    python3 -m bench.ptxas_report --cache /tmp/tc [--only-notes]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# the note, without where it is (" in the function ..."; newer ptxas add " in line N")
_NOTE = re.compile(r"\((C\d+)\) Potential Performance Loss: (.*?)(?: in the function .*)?$")


@dataclass(frozen=True)
class Build:
    """One compiled kernel as ptxas reports it."""

    name: str
    num_warps: int
    num_stages: int
    shared: int
    registers: int
    spill_bytes: int
    notes: tuple[str, ...]  # "C7515: wgmma.mma_async instructions are serialized due to ..."


def ptxas_path(arch: int = 90) -> Path:
    """The ptxas Triton itself assembles ``sm_<arch>`` PTX with (its CUDA backend's choice of bundled binaries)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return Path(get_ptxas(arch).path)


def parse_ptxas(output: str) -> tuple[int, int, tuple[str, ...]]:
    """(registers, spilled bytes stored, performance notes) from ``ptxas -v`` output for one kernel."""
    registers = re.search(r"Used (\d+) registers", output)
    spills = re.search(r"(\d+) bytes spill stores", output)
    notes = tuple(f"{m.group(1)}: {m.group(2)}" for line in output.splitlines() if (m := _NOTE.search(line.strip())))
    return int(registers.group(1)) if registers else 0, int(spills.group(1)) if spills else 0, notes


def builds(cache: Path) -> list[Build]:
    """Every kernel build in ``cache`` (a PTX file with its metadata JSON beside it), assembled once each by the
    ptxas Triton uses for its target."""
    out = []
    for ptx in sorted(cache.glob("*/*.ptx")):
        meta = json.loads(ptx.with_suffix(".json").read_text())
        target = re.search(r"^\.target\s+(\w+)", ptx.read_text(), re.MULTILINE)
        arch = target.group(1) if target else f"sm_{meta['target']['arch']}"
        ptxas = ptxas_path(meta["target"]["arch"])
        run = subprocess.run([str(ptxas), f"-arch={arch}", "-v", str(ptx), "-o", os.devnull], capture_output=True,
                             text=True, check=True)  # fmt: skip
        registers, spills, notes = parse_ptxas(run.stdout + run.stderr)
        name = meta.get("name", ptx.stem)
        out.append(Build(name, meta["num_warps"], meta["num_stages"], meta.get("shared", 0), registers, spills, notes))
    return out


def report(found: list[Build], only_notes: bool = False) -> list[str]:
    """Lines of the report: distinct builds by name (with how many cache entries each), notes under their build."""
    lines = [f"{'kernel':28s} {'n':>3s} {'warps':>5s} {'stages':>6s} {'shared':>7s} {'regs':>4s} {'spill':>5s}"]
    for b, n in sorted(Counter(found).items(), key=lambda item: (item[0].name, item[0].registers)):
        if only_notes and not b.notes:
            continue
        lines.append(f"{b.name:28s} {n:3d} {b.num_warps:5d} {b.num_stages:6d} {b.shared:7d} {b.registers:4d} "
                     f"{b.spill_bytes:5d}")  # fmt: skip
        lines += [f"    {note}" for note in b.notes]
    return lines


def main(argv: list[str] | None = None) -> None:
    import triton

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", default=triton.knobs.cache.dir, help="a Triton cache directory")
    parser.add_argument("--only-notes", action="store_true", help="only the builds ptxas has a performance note for")
    args = parser.parse_args(argv)
    found = builds(Path(args.cache))
    if not found:
        raise SystemExit(f"no compiled CUDA kernels (PTX files) under {args.cache}")
    print("\n".join(report(found, args.only_notes)))


if __name__ == "__main__":
    main()
