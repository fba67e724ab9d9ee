import pytest
import torch

from kernels.attention import paged_decode_attention
from kernels.moe import bf16_moe
from kernels.pdl import enabled, launch_args
from kernels.rms_norm import rms_norm
from kernels.router import route
from kernels.short_conv import conv_decode, kv_prologue
from kernels.skinny_gemm import skinny_linear, skinny_swiglu

H, N_HEADS, N_KV, HD, D_REL, REL = 1024, 8, 2, 128, 16, 64
PAGE, SEQ_LEN, CONV_K = 16, 40, 4
E, S, TOP_K, I = 64, 2, 4, 256
EPS = 1e-6


def test_no_pdl_off_the_gpu(cpu_interpreter):
    cpu = torch.device("cpu")
    assert not enabled(True, cpu)
    assert launch_args(True, cpu) == {"PDL": False}
    assert launch_args(False, cpu) == {"PDL": False}


def _decode_step_inputs(device: torch.device) -> dict[str, torch.Tensor]:
    """One decode row's weights and caches (bf16), shapes of a small Inkling layer."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)

    widths = (N_HEADS * HD, N_KV * HD, N_KV * HD, N_HEADS * D_REL)
    pages = torch.randperm(8, generator=gen)[: -(-SEQ_LEN // PAGE)].to(torch.int32)
    row = int(pages[(SEQ_LEN - 1) // PAGE]) * PAGE + (SEQ_LEN - 1) % PAGE
    return {
        "x": rand(1, H),
        "norm": rand(H, scale=0.1) + 1,
        "qkvr": rand(sum(widths), H, scale=H**-0.5),
        "wo": rand(H, N_HEADS * HD, scale=(N_HEADS * HD) ** -0.5),
        "k_states": rand(3, CONV_K - 1, N_KV * HD),
        "v_states": rand(3, CONV_K - 1, N_KV * HD),
        "h_states": rand(3, CONV_K - 1, H),
        "k_conv": rand(N_KV * HD, CONV_K, scale=0.3, dtype=torch.float32),
        "v_conv": rand(N_KV * HD, CONV_K, scale=0.3, dtype=torch.float32),
        "h_conv": rand(H, CONV_K, scale=0.3, dtype=torch.float32),
        "k_norm": rand(HD, scale=0.1) + 1,
        "q_norm": rand(HD, scale=0.1) + 1,
        "k_pool": rand(8 * PAGE, N_KV, HD),
        "v_pool": rand(8 * PAGE, N_KV, HD),
        "rel_proj": rand(D_REL, REL, scale=0.1),
        "table": pages[None].to(device),
        "seq_lens": torch.tensor([SEQ_LEN], dtype=torch.int32, device=device),
        "kv_rows": torch.tensor([row], device=device),
        "slots": torch.tensor([1], device=device),
        "gate": rand(E + S, H, scale=H**-0.5),
        "gate_bias": rand(E, scale=0.1, dtype=torch.float32),
        "gate_scale": torch.ones(1, device=device),
        "w13": rand(E, 2 * I, H, scale=H**-0.5),
        "w2": rand(E, H, I, scale=I**-0.5),
        "shared_w13": rand(S * 2 * I, H, scale=H**-0.5),
        "shared_w2": rand(H, S * I, scale=(S * I) ** -0.5),
    }


def _decode_step(t: dict[str, torch.Tensor], pdl: bool) -> torch.Tensor:
    """A layer's chain of decode kernels, each reading what the one before it wrote (the caches in place)."""
    h = rms_norm(t["x"], t["norm"], EPS, pdl=pdl)
    q, k0, v0, r = skinny_linear(h, t["qkvr"], pdl=pdl).split((N_HEADS * HD, N_KV * HD, N_KV * HD, N_HEADS * D_REL), -1)
    q = kv_prologue(
        k0, v0, t["k_states"], t["v_states"], t["slots"], t["k_conv"], t["v_conv"], t["k_norm"], EPS,
        t["k_pool"], t["v_pool"], t["kv_rows"], q.view(1, N_HEADS, HD), t["q_norm"], EPS, pdl=pdl,
    )  # fmt: skip
    a = paged_decode_attention(
        q, r.view(1, N_HEADS, D_REL), t["rel_proj"], t["k_pool"], t["v_pool"], t["table"], t["seq_lens"], PAGE,
        pdl=pdl,
    )  # fmt: skip
    a = skinny_linear(a.view(1, N_HEADS * HD), t["wo"], residual=t["x"], pdl=pdl)
    y, _ = conv_decode(a, t["h_states"], t["slots"], t["h_conv"], residual=t["x"], pdl=pdl)
    ids, weights, gammas = route(y, t["gate"], t["gate_bias"], TOP_K, 2.5, t["gate_scale"], pdl=pdl)
    routed = bf16_moe(y, ids, weights, t["w13"], t["w2"], pdl=pdl)
    act = skinny_swiglu(y, t["shared_w13"], I, gammas=gammas, pdl=pdl)
    return skinny_linear(act, t["shared_w2"], residual=routed, pdl=pdl)


@pytest.mark.gpu
def test_pdl_chain_in_a_cuda_graph_equals_the_plain_launches(cuda_device):
    """The chain captured with PDL launches, replayed many times, gives exactly the plain launches' results (same
    kernels and arithmetic: a kernel reading its predecessor's output too early would differ), caches included."""
    if not enabled(True, cuda_device):
        pytest.skip("PDL needs sm_90 or later")
    inputs = _decode_step_inputs(cuda_device)
    caches = ("k_states", "v_states", "h_states", "k_pool", "v_pool")
    initial = {name: inputs[name].clone() for name in caches}

    def restore() -> None:
        for name in caches:
            inputs[name].copy_(initial[name])

    expected = _decode_step(inputs, pdl=False)
    expected_caches = {name: inputs[name].clone() for name in caches}
    restore()
    _decode_step(inputs, pdl=True)  # compiles the PDL variants before the capture
    restore()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _decode_step(inputs, pdl=True)
    for _ in range(20):
        restore()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
        for name in caches:
            assert torch.equal(inputs[name], expected_caches[name]), name
