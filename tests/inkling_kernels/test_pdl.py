"""Programmatic dependent launch: every kernel waits before it touches another kernel's data (checked on the
source, since a kernel that skips the wait is a race only a GPU shows, and then not always), every launch passes
the options, and on the GPU a graph of dependent launches gives what the same launches give one at a time."""

import ast
import pathlib

import pytest
import torch

import inkling_kernels
from inkling_kernels.pdl import pdl
from inkling_kernels.rms_norm import rms_norm
from inkling_kernels.skinny_gemm import skinny_linear

PACKAGE = pathlib.Path(inkling_kernels.__file__).parent


def _kernels() -> list[tuple[str, ast.FunctionDef]]:
    found = []
    for path in sorted(PACKAGE.glob("_triton_*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                found.append((f"{path.name}:{node.name}", node))
    return found


def _launches() -> list[tuple[str, ast.Call]]:
    found = []
    for path in sorted(PACKAGE.glob("[a-z]*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            launched = isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
            if launched and isinstance(node.func.value, ast.Attribute) and node.func.value.attr.endswith("_kernel"):
                found.append((f"{path.name}:{node.func.value.attr}", node))
    return found


# kernels whose wait sits in a helper, after weight loads that nothing before the wait depends on
WAITS_IN = {"skinny_gemm_kernel": "_accumulate"}


def _first_statement(node: ast.FunctionDef) -> str:
    body = node.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):  # the docstring
        body = body[1:]
    return ast.unparse(body[0])


def test_every_kernel_waits_first():
    kernels = _kernels()
    assert len(kernels) >= 20
    for name, node in kernels:
        assert [a.arg for a in node.args.args][-1] == "PDL", name
        helper = WAITS_IN.get(node.name)
        if helper is None:
            assert _first_statement(node) == "pdl_wait(PDL)", f"{name} starts with {_first_statement(node)!r}"
            continue
        source = (PACKAGE / name.split(":")[0]).read_text()
        body = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == helper)
        calls = [ast.unparse(c) for c in ast.walk(body) if isinstance(c, ast.Call)]
        assert "pdl_wait(PDL)" in calls and f"{helper}(" in ast.unparse(node), name


def test_every_launch_passes_the_options():
    launches = _launches()
    assert {name.split(":")[1] for name, _ in launches} == {name.split(":")[1] for name, _ in _kernels()}
    for name, call in launches:
        spread = [k.value for k in call.keywords if k.arg is None]
        assert any(isinstance(v, ast.Call) and ast.unparse(v.func) == "pdl" for v in spread), name


def test_no_pdl_off_the_gpu():
    assert pdl(torch.zeros(1)) == {"PDL": False}


@pytest.mark.gpu
def test_a_graph_of_dependent_launches_equals_them_one_at_a_time(cuda_device):
    if torch.cuda.get_device_capability(cuda_device) < (9, 0):
        pytest.skip("programmatic dependent launch needs Hopper or later")
    assert pdl(torch.zeros(1, device=cuda_device))["PDL"]
    gen = torch.Generator(device=cuda_device).manual_seed(0)
    weights = [torch.randn(4096, 4096, device=cuda_device, generator=gen).to(torch.bfloat16) / 64 for _ in range(6)]
    norm = (torch.rand(4096, device=cuda_device, generator=gen) + 0.5).to(torch.bfloat16)
    x = torch.randn(1, 4096, device=cuda_device, generator=gen).to(torch.bfloat16)

    def chain(sync: bool) -> torch.Tensor:  # each launch reads what the one before it wrote
        y = x
        for w in weights:
            y = skinny_linear(rms_norm(y, norm, 1e-6), w)
            if sync:
                torch.cuda.synchronize()
        return y

    one_at_a_time = chain(sync=True)
    graph = torch.cuda.CUDAGraph()
    chain(sync=False)
    with torch.cuda.graph(graph):
        out = chain(sync=False)
    for _ in range(50):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, one_at_a_time)
