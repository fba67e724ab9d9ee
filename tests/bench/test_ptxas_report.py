import os
import subprocess
import sys

import pytest

from bench.ptxas_report import Build, main, parse_ptxas, report

# ptxas -v on the NVFP4 prefill gate/up tile before its wgmma drain (Triton 3.6, sm_90a)
SERIALISED = """ptxas info    : 11 bytes gmem
ptxas info    : Compiling entry function 'moe_w13_kernel' for 'sm_90a'
ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma \
instructions defining accumulator registers of a wgmma between start and end of the pipeline stage in the function \
'moe_w13_kernel'
ptxas info    : Function properties for moe_w13_kernel
    24 bytes stack frame, 24 bytes spill stores, 24 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 24 bytes cumulative stack size
"""


def test_parse_reads_registers_spills_and_performance_notes():
    registers, spills, notes = parse_ptxas(SERIALISED)
    assert (registers, spills) == (255, 24)
    assert notes == (
        "C7515: wgmma.mma_async instructions are serialized due to non wgmma instructions defining accumulator "
        "registers of a wgmma between start and end of the pipeline stage",
    )
    assert parse_ptxas(SERIALISED.replace("'moe_w13_kernel'\n", "'moe_w13_kernel' in line 1275\n"))[2] == notes
    assert parse_ptxas("ptxas info    : Used 40 registers, used 0 barriers") == (40, 0, ())


def test_report_counts_identical_builds_and_can_keep_only_noted_ones():
    plain = Build("moe_sum_kernel", 4, 3, 0, 34, 0, ())
    noted = Build("moe_w13_kernel", 4, 3, 67584, 168, 0, ("C7515: serialized",))
    lines = report([plain, noted, plain])
    assert lines[1].split() == ["moe_sum_kernel", "2", "4", "3", "0", "34", "0"]
    assert lines[3].strip() == "C7515: serialized"
    assert [line.split()[0] for line in report([plain, noted], only_notes=True)[1:]] == ["moe_w13_kernel", "C7515:"]


# a kernel compiled for sm_90 without a GPU, in a process of its own: the interpreter that other tests run
# (TRITON_INTERPRET=1) patches triton.language in this one
_COMPILE = """
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _double(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < N) * 2.0, mask=offs < N)


src = ASTSource(_double, {"X": "*fp32", "Y": "*fp32", "N": "i32", "BLOCK": "constexpr"}, {(3,): 256})
triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 2})
"""


def test_report_of_a_kernel_compiled_without_a_gpu(tmp_path, capsys):
    """A kernel compiled here for sm_90 into a fresh cache, then read back and assembled."""
    script, cache = tmp_path / "double.py", tmp_path / "cache"
    script.write_text(_COMPILE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(cache)}
    subprocess.run([sys.executable, str(script)], env=env, check=True, capture_output=True, timeout=300)
    main(["--cache", str(cache)])
    row = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("_double")]
    assert len(row) == 1 and row[0][1:3] == ["1", "2"] and int(row[0][5]) > 0, row
    with pytest.raises(SystemExit, match="no compiled CUDA kernels"):
        main(["--cache", str(tmp_path / "empty")])
