"""Weight-quantized models work with RopeKVCache unchanged (issue 4, part 1).

optimum-quanto int8 and int4, both ways a user gets them: ``quantize(model, weights=...)`` + ``freeze(model)``
on a loaded model, and ``QuantoConfig`` at load time (``from_pretrained`` of a checkpoint). On the same quantized
model, RopeKVCache with nothing evicted (``budget=None`` and a budget larger than the generation) gives exactly
DynamicCache's greedy tokens, and generation with eviction completes within the budget. The default scorer
gathers its query statistics online through hooks on ``q_proj`` / ``q_norm`` outputs, so these tests also show
that the hooks work on quantized linears. bitsandbytes 4-bit NF4 (``BitsAndBytesConfig``) gets the same checks on
the CPU (bitsandbytes >= 0.46) and, with the gpu marker, on CUDA.

optimum-quanto and bitsandbytes are optional (``pip install hf_ropekv[quanto,bnb]``); without them their tests
are skipped (CI installs both).

quanto unpacks int4 weights with a C++ extension that it compiles on first use (2-3 minutes with ninja and a
compiler on a fresh environment). Unless ``HF_ROPEKV_QUANTO_NATIVE=1``, the tests serve that one operation
from quanto's own pure-PyTorch implementation of it (same result, no compilation); everything else is quanto's.
"""

from __future__ import annotations

import os
import types

import pytest
import torch
from transformers import DynamicCache

from conftest import generate_with_logits, padded_batch, tiny_model
from hf_ropekv import RopeKVCache

ARCHS = ["llama", "qwen3"]
WEIGHTS = ["int8", "int4"]
BUDGET, COMPRESS_EVERY = 16, 8


# ---------------------------------------------------------------------------------------------- helpers
def _unpack_uint8(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """optimum-quanto's pure-PyTorch ``quanto::unpack`` (its default implementation), for the shim below."""
    parts = [(packed & (2 ** (bits * (i + 1)) - 1)) >> (bits * i) for i in range(8 // bits)]
    return torch.cat(parts).to(torch.uint8)


@pytest.fixture(scope="module")
def quanto():
    """The ``optimum.quanto`` module (tests skip without it), its int4 unpack served without compiling."""
    module = pytest.importorskip("optimum.quanto")
    if os.environ.get("HF_ROPEKV_QUANTO_NATIVE") != "1":
        try:
            from optimum.quanto.library.extensions import get_extension
        except ImportError:  # another quanto layout: let it compile
            get_extension = None
        for name in ("quanto_cpp",):
            try:
                ext = get_extension(name) if get_extension else None
            except KeyError:
                ext = None
            if ext is not None and getattr(ext, "_lib", None) is None:
                ext._lib = types.SimpleNamespace(unpack=_unpack_uint8)
    return module




def quanto_quantize(quanto, model, weights: str):
    qtype = {"int8": quanto.qint8, "int4": quanto.qint4}[weights]
    quanto.quantize(model, weights=qtype)
    quanto.freeze(model)
    return model


def assert_quantized(quanto, model, weights: str) -> None:
    """Every decoder linear is a quanto module holding a quantized weight of the right kind."""
    from optimum.quanto import QTensor

    linears = [m for name, m in model.named_modules() if name.endswith(("q_proj", "k_proj", "down_proj"))]
    assert linears
    for module in linears:
        assert isinstance(module, quanto.QModuleMixin), type(module)
        assert isinstance(module.weight, QTensor), type(module.weight)
        assert module.weight.qtype == {"int8": quanto.qint8, "int4": quanto.qint4}[weights]


def check_exact(model, atol: float = 1e-5) -> None:
    """budget=None and a budget larger than the generation: DynamicCache's tokens exactly, logits within
    ``atol``, nothing compacted."""
    ids, mask = (t.to(model.device) for t in padded_batch(model.config.vocab_size))
    ref = generate_with_logits(model, DynamicCache(config=model.config), ids, mask)
    for budget in (None, 4096):
        cache = RopeKVCache(model, budget=budget)
        out = generate_with_logits(model, cache, ids, mask)
        assert torch.equal(out.sequences, ref.sequences), f"budget={budget}"
        for got, want in zip(out.logits, ref.logits):
            torch.testing.assert_close(got, want, atol=atol, rtol=0)
        assert cache.num_compactions == 0
        assert cache.tokens_kept == cache.tokens_seen == ids.shape[1] + 19


def check_eviction(model, max_new_tokens: int = 40) -> None:
    """A budget far below the generation: it completes, compacts, and keeps at most budget + compress_every."""
    ids, mask = (t.to(model.device) for t in padded_batch(model.config.vocab_size))
    cache = RopeKVCache(model, budget=BUDGET, compress_every=COMPRESS_EVERY)  # default scorer, online statistics
    out = generate_with_logits(model, cache, ids, mask, max_new_tokens=max_new_tokens)
    assert out.sequences.shape == (ids.shape[0], ids.shape[1] + max_new_tokens)
    assert cache.tokens_seen == ids.shape[1] + max_new_tokens - 1
    assert cache.num_compactions > 0
    assert BUDGET <= cache.tokens_kept <= BUDGET + COMPRESS_EVERY
    assert all(bool(torch.isfinite(step).all()) for step in out.logits)


# ---------------------------------------------------------------------------------------------- quantize() + freeze()
@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_quantize_freeze_identical_when_nothing_is_evicted(quanto, arch: str, weights: str) -> None:
    model = quanto_quantize(quanto, tiny_model(arch), weights)
    assert_quantized(quanto, model, weights)
    check_exact(model)


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_quantize_freeze_generation_with_eviction(quanto, arch: str, weights: str) -> None:
    model = quanto_quantize(quanto, tiny_model(arch), weights)
    check_eviction(model)


# ------------------------------------------------------------------------------------------- QuantoConfig at load time
@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_quanto_config_at_load_time(quanto, tmp_path, arch: str, weights: str) -> None:
    from transformers import AutoModelForCausalLM, QuantoConfig

    tiny_model(arch).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=QuantoConfig(weights=weights), dtype=torch.float32
    ).eval()
    assert_quantized(quanto, model, weights)
    check_exact(model)
    check_eviction(model)


# ---------------------------------------------------------------------------------------------- bitsandbytes NF4
def load_bnb_nf4(tmp_path, arch: str, device: str, dtype: torch.dtype):
    """A tiny checkpoint loaded in 4-bit NF4 through ``BitsAndBytesConfig``, as a user would load a real one."""
    bnb = pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_model(arch).save_pretrained(tmp_path)
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=config, dtype=dtype, device_map=device
    ).eval()
    linears = [m for name, m in model.named_modules() if name.endswith(("q_proj", "k_proj", "down_proj"))]
    assert linears and all(isinstance(m, bnb.nn.Linear4bit) for m in linears)
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_bitsandbytes_nf4_on_cpu(tmp_path, arch: str) -> None:
    # bitsandbytes >= 0.46 runs NF4 on the CPU too, so CI covers this path; the GPU test below covers CUDA.
    model = load_bnb_nf4(tmp_path, arch, "cpu", torch.float32)
    check_exact(model)
    check_eviction(model)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_bitsandbytes_nf4_on_cuda(tmp_path, arch: str, deterministic_sdpa) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = load_bnb_nf4(tmp_path, arch, "cuda", torch.float16)
    check_exact(model, atol=0.0)
    check_eviction(model)
