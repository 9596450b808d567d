"""The one-kernel RMSNorm against its PyTorch twin, and the twin against transformers' own RMSNorm module.

Under Triton's interpreter on CPU tensors (the ``gpu`` twin runs it compiled). The kernel sums the squares in its own
order, so the float32 variance may differ in its last bit from torch's mean: after the rounding to the input dtype the
normalized row differs from the reference's by at most one unit in the last place of that dtype, and rarely; times
the weight and rounded again, an output by at most two. Triton's interpreter truncates float32 to bfloat16 instead
of rounding to nearest, at both roundings: there bf16 outputs may be three units off, and often one.
"""
from __future__ import annotations

import pytest
import torch
from hf_ropekv.kernels.rms_norm import MAX_NORM_DIM, rms_norm, rms_norm_reference

ULP = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def _gen(device: str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    print("seed", gen.seed())  # fresh inputs on every run; pytest shows the seed of a failure
    return gen


def _inputs(shape, dtype, weight_dtype, gen, device="cpu"):
    # activations with a few large channels, as a residual stream has; weights around 1, as trained norms have
    x = torch.randn(shape, generator=gen, device=device) * torch.rand(shape[-1], generator=gen, device=device) * 3
    x[..., 7] *= 40
    weight = 1 + 0.3 * torch.randn(shape[-1], generator=gen, device=device)
    return x.to(dtype), weight.to(weight_dtype)


def check_close(out: torch.Tensor, ref: torch.Tensor, x_dtype: torch.dtype) -> None:
    """``out`` within the last-place units of ``x_dtype`` (the normalized row is rounded to it) of ``ref``."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    truncated = x_dtype == torch.bfloat16 and not out.is_cuda  # the interpreter's casts (module docstring)
    # A unit off in the normalized row (rounded to x's dtype) is scaled by the weight, up to about 2 (1.34 gave 1.33
    # units), before the product is rounded again; the interpreter's truncation adds a unit. float32: the variance's
    # last bits, unrounded.
    units = 4 if x_dtype == torch.float32 else 3 if truncated else 2
    step = ULP[x_dtype] * ref.float().abs().clamp_min(2.0 ** -10)
    assert ((out.float() - ref.float()).abs() <= step * units * 1.01).all()
    if x_dtype != torch.float32 and not truncated:
        assert (out == ref).float().mean() > 0.98  # a different last bit is the exception, not the rule


@pytest.mark.parametrize("shape", [(1, 1, 4096), (3, 5, 128), (2, 7, 1, 96), (4, 1000)])
@pytest.mark.parametrize("dtype,weight_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                                (torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_the_kernel_matches_the_reference(shape, dtype, weight_dtype, triton_interpreter) -> None:
    gen = _gen()
    x, weight = _inputs(shape, dtype, weight_dtype, gen)
    out = torch.full(shape, float("nan"), dtype=torch.promote_types(dtype, weight_dtype))  # poisoned
    result = rms_norm(x, weight, 1e-6, out=out)
    assert result is out
    check_close(out, rms_norm_reference(x, weight, 1e-6), dtype)


def test_a_strided_input_is_read_where_it_lies(triton_interpreter) -> None:
    gen = _gen()
    x, weight = _inputs((4, 6, 64), torch.bfloat16, torch.bfloat16, gen)
    view = x.transpose(0, 1)  # rows not in memory order
    check_close(rms_norm(view, weight, 1e-5), rms_norm_reference(view, weight, 1e-5), torch.bfloat16)


def test_the_reference_is_transformers_rms_norm() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = _gen()
    x, weight = _inputs((2, 3, 256), torch.bfloat16, torch.bfloat16, gen)
    module = LlamaRMSNorm(256, eps=1e-5).to(torch.bfloat16)
    module.weight.data.copy_(weight)
    assert torch.equal(module(x), rms_norm_reference(x, weight, 1e-5))


def test_bad_arguments_are_refused_by_name(triton_interpreter) -> None:
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="rows of 1 to"):
        rms_norm(torch.randn(1, MAX_NORM_DIM + 1), torch.ones(MAX_NORM_DIM + 1), 1e-6)
    with pytest.raises(ValueError, match="out must be"):
        rms_norm(x, torch.ones(64), 1e-6, out=torch.empty(2, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        rms_norm(x.double(), torch.ones(64), 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernel_matches_the_reference_on_cuda(dtype) -> None:
    gen = _gen("cuda")
    for shape in [(1, 1, 4096), (1, 32, 1, 128), (32, 1, 4096), (5, 3584)]:
        x, weight = _inputs(shape, dtype, dtype, gen, "cuda")
        out = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
        check_close(rms_norm(x, weight, 1e-6, out=out), rms_norm_reference(x, weight, 1e-6), dtype)
