"""The low-precision GEMM choice follows the CPU's flags, and both choices are exact enough.

`lowp_gemm_choice` is a pure function of the CPU flags, so the choice is forced here for CPUs
this machine is not: an AVX2 CPU gets fp32 emulation, AVX512-BF16 / AMX CPUs get native bf16.
On this machine the flags' choice must agree with what the kernels use (oneDNN's own query).
Then the kernels are forced down each path (the per-process decision replaced for one test)
and a bf16 MoE layer is checked against the reference loop (layers/reference.py) on its fp32
twin: outputs and all gradients.
"""

from __future__ import annotations

import pytest
import torch

from moescale import MoE, ReferenceMoE
from moescale.bench.disk_probe import cpu_flags
from moescale.layers import grouped_ffn

AVX2 = ["avx", "avx2", "fma"]
AVX512_BF16 = AVX2 + ["avx512f", "avx512bw", "avx512_bf16"]
SAPPHIRE = AVX512_BF16 + ["amx_bf16", "amx_tile", "avx512_fp16", "amx_fp16"]


def test_choice_forced_by_flags():
    bf16, fp16 = torch.bfloat16, torch.float16
    assert grouped_ffn.lowp_gemm_choice(bf16, AVX2) == "fp32"
    assert grouped_ffn.lowp_gemm_choice(bf16, AVX512_BF16) == "native"
    assert grouped_ffn.lowp_gemm_choice(bf16, ["amx_bf16"]) == "native"
    assert grouped_ffn.lowp_gemm_choice(fp16, AVX512_BF16) == "fp32"
    assert grouped_ffn.lowp_gemm_choice(fp16, SAPPHIRE) == "native"
    assert grouped_ffn.lowp_gemm_choice(torch.float32, AVX2) == "native"


def test_choice_on_this_cpu_matches_the_kernels():
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags here")
    kernels = "fp32" if grouped_ffn.needs_fp32_gemm(torch.empty(1, dtype=torch.bfloat16)) \
        else "native"
    assert grouped_ffn.lowp_gemm_choice(torch.bfloat16, flags) == kernels


@pytest.mark.parametrize("block_rows", [None, 5], ids=["one-block", "5-row-blocks"])
@pytest.mark.parametrize("choice", ["native", "fp32"])
@pytest.mark.parametrize("glu", [False, True], ids=["gelu", "glu"])
def test_forced_choice_matches_fp32_reference(monkeypatch, choice, glu, block_rows):
    monkeypatch.setattr(grouped_ffn, "_cpu_lacks_fast_lowp",
                        lambda dtype: choice == "fp32" and dtype != torch.float32)
    if block_rows:      # backward's elementwise blocks split each expert's rows, last partial
        monkeypatch.setattr(grouped_ffn, "ELEMENTWISE_BYTES", 1)
        monkeypatch.setattr(grouped_ffn, "MIN_ELEMENTWISE_ROWS", block_rows)
    x16 = torch.empty(1, dtype=torch.bfloat16)
    assert grouped_ffn.needs_fp32_gemm(x16) == (choice == "fp32")
    assert grouped_ffn.work_dtype(x16) == (torch.float32 if choice == "fp32" else torch.bfloat16)
    torch.manual_seed(0)
    ref = MoE(32, 8, 2, d_ff=64, glu=glu, activation="silu" if glu else "gelu")
    moe = MoE(32, 8, 2, d_ff=64, glu=glu, activation="silu" if glu else "gelu")
    moe.load_state_dict(ref.state_dict())
    moe = moe.to(torch.bfloat16)
    with torch.no_grad():                      # the reference starts from the rounded weights
        for p, q in zip(ref.parameters(), moe.parameters()):
            p.copy_(q.float())
    oracle = ReferenceMoE(ref)                 # the slow loop on the fp32 twin
    x = torch.randn(256, 32).to(torch.bfloat16)
    g = torch.randn(256, 32)
    xr = x.float().requires_grad_(True)
    xb = x.clone().requires_grad_(True)
    y_ref = oracle(xr)
    (y_ref * g).sum().backward()
    y = moe(xb)
    (y.float() * g).sum().backward()
    assert (y.float() - y_ref).abs().max() < 0.03 * y_ref.abs().max()
    for (name, p), q in zip(ref.named_parameters(), moe.parameters()):
        err = (q.grad.float() - p.grad).abs().max()
        assert err < 0.03 * p.grad.abs().max() + 1e-6, name
    assert (xb.grad.float() - xr.grad).abs().max() < 0.03 * xr.grad.abs().max()
