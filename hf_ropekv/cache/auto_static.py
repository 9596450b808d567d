"""``static="auto"`` (the default): decode static where it pays, eagerly everywhere else.

A static cache's decode step, replayed as a CUDA graph, is faster per step than the growing cache eager, but it
costs a warm-up: recording the graph of the eager step (``cuda_graphs``, the default for these caches on one CUDA
device: 0.17-0.24 s for an 8B model) or compiling it (``torch.compile`` by ``generate()``: 77.7 s for an 8B model in
a fresh process, DESIGN.md §7; less for later calls, which reuse the compiled step). It pays only on CUDA and for
generations long enough to earn the warm-up back; a notebook on the CPU or a short answer must never be slower than
eager.

So an ``"auto"`` cache is built growing (eager) and decides once, when ``generate()`` asks whether it may compile
its forward (``_valid_auto_compile_criteria``, wrapped per model by ``hooks.generate_methods``; the same call on
transformers 5.17 through 5.24, made before the first forward of ``_sample``). The cache goes static (its layers
rebuilt by ``RopeKVCache._assemble``) when all of these hold, and stays eager otherwise:

- it holds no tokens yet (a cache continued from an earlier call keeps the mode it has);
- it can be static (a budget, the model, one window size for all sliding-window layers, a scorer that needs no
  query window: ``model_checks.static_error``);
- no rollback is expected (assisted decoding crops the cache) and compilation is not disabled;
- the model is on CUDA (or the compile config asks to compile on every device: ``_compile_all_devices``);
- the generation asks for at least :data:`AUTO_GRAPHED_MIN_NEW_TOKENS` new tokens where its steps will replay CUDA
  graphs (:func:`replays_cuda_graphs`), :data:`AUTO_STATIC_MIN_NEW_TOKENS` where generate compiles them;
- transformers itself then agrees to compile (quantizers, offloading): its own criteria, asked with the static
  layers in place.

A cache whose first forward comes before any such decision (a hand-written loop, a decoding mode that never
compiles) settles eager then. Each cache logs its decision once, at INFO level; ``cache.static_reason`` keeps it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from transformers.utils import logging

from ..hooks.graphed_step import not_capturable

if TYPE_CHECKING:
    from .cache import RopeKVCache

logger = logging.get_logger(__name__)

#: Fewest new tokens (``max_new_tokens``) for which an ``"auto"`` cache decodes compiled: where the compile warm-up
#: is paid back by the faster steps. Measured on an H200 (Qwen3-8B shape, bf16, batch 1, 4K prompt, budget 2048,
#: benchmarks/results/warmup_2026-12-03_64ecf86): in a second process (torch's on-disk compile caches warm) the
#: warm-up cost 9.9 s (first decode step 8.4 s, prefill +1.5 s) and each later step saved 10.5 ms against the
#: growing cache eager (10.15 against 20.61 ms): even at 944 tokens. Rounded up to 1024. A fresh machine pays more
#: (a 70 s cold compile: about 6,700 tokens; 20 s with shipped artifacts: about 1,900), a process that compiled
#: this shape already pays nothing. The decision reads it at every call: changing it here (or monkeypatching it)
#: takes effect at once.
AUTO_STATIC_MIN_NEW_TOKENS = 1024

#: :data:`AUTO_STATIC_MIN_NEW_TOKENS` for a cache whose static steps replay CUDA graphs (``cuda_graphs=True``, or
#: ``"auto"``, the default, on one CUDA device: :func:`replays_cuda_graphs`), which need no compile: its
#: warm-up is one eager step and a capture. Measured on an H200 (Qwen3-8B shape, bf16, batch 1, 4K prompt, budget
#: 2048, benchmarks/results/graphed_step_probe_2026-12-04): the first decode step took 0.17-0.24 s and later steps
#: 13.4-13.7 ms, against 20.6 ms for the growing cache eager (warmup_2026-12-03_64ecf86, above): paid back in
#: about 35 tokens. 64 keeps a margin for slower GPUs.
AUTO_GRAPHED_MIN_NEW_TOKENS = 64

#: ``static_reason`` of an ``"auto"`` cache before its decision.
PENDING = "auto: undecided until generate() asks whether to compile (before its first forward)"


def unsupported_reason(cache: "RopeKVCache", model: Any) -> str | None:
    """Why ``cache`` can never be static (checked once, when it is built), or None: it can."""
    from .model_checks import static_error

    if cache.budget is None:
        return "no budget: the fixed arena holds budget + compress_every slots"
    if model is None:
        return "built from a config: a static cache needs the model's hooks"
    if cache._queries is not None:
        return f"{type(cache.scorer).__name__} needs a growing window of recent queries"
    error = static_error(cache.geometry, cache.budget, model, cache.scorer)
    return None if error is None else error.split(";")[0]


def new_tokens(model_kwargs: dict[str, Any], generation_config: Any) -> int | None:
    """Tokens this generation asks for: ``max_new_tokens``, else ``max_length`` less the prompt (None: unknown)."""
    wanted = getattr(generation_config, "max_new_tokens", None)
    if wanted is not None:
        return int(wanted)
    max_length = getattr(generation_config, "max_length", None)
    mask = model_kwargs.get("attention_mask")
    if max_length is None or mask is None or getattr(mask, "ndim", 0) != 2:
        return None
    return int(max_length) - mask.shape[-1]


def decide(cache: "RopeKVCache", model: Any, criteria: Callable[[dict, Any], bool], model_kwargs: dict[str, Any],
           generation_config: Any) -> bool:
    """Settle an ``"auto"`` cache's mode for this ``generate()`` call; returns what ``criteria`` (transformers'
    ``_valid_auto_compile_criteria``) answers with the cache as settled."""
    cache._cuda_graphs_now = replays_cuda_graphs(cache, model)  # before the threshold, which depends on it
    reason = _eager_reason(cache, model, model_kwargs, generation_config)
    if reason is None:
        cache._assemble(static=True)
        if criteria(model_kwargs, generation_config):
            device = getattr(getattr(model, "device", None), "type", None)
            how = "replays the decode step as a CUDA graph" if cache.cuda_graphs else "compiles the decode step"
            cache._settle(True, f"auto: on {device}, max_new_tokens={new_tokens(model_kwargs, generation_config)} >= "
                                f"{min_new_tokens(cache)}, generate() {how}")
            return True
        cache._assemble(static=False)
        reason = "transformers would not compile this model's forward (quantization or offloading)"
    cache._cuda_graphs_now = False
    cache._settle(False, "auto: " + reason)
    return criteria(model_kwargs, generation_config)


def replays_cuda_graphs(cache: "RopeKVCache", model: Any) -> bool:
    """Whether ``cache``'s static decode steps replay CUDA graphs of the eager step (else generate compiles them):
    ``cuda_graphs=True``; for ``"auto"`` (the default), a ``static="auto"`` cache whose model sits on one CUDA
    device and one rank. Elsewhere a capture could not hold the step (``hooks.graphed_step``), and the static steps
    would run eagerly, slower than the growing cache's; there generate's compile is asked instead (an explicit
    ``static=True`` always is: it asked for a compileable cache)."""
    setting = cache.options.cuda_graphs
    if setting != "auto":
        return setting
    if cache.options.static != "auto" or model is None:
        return False
    return not_capturable(model, getattr(model, "device", torch.device("cpu"))) is None


def _eager_reason(cache: "RopeKVCache", model: Any, model_kwargs: dict[str, Any], generation_config: Any) -> str | None:
    if cache.tokens_seen:
        return "the cache already holds tokens from an earlier call"
    if cache.coordinator.rollback_expected:
        return "assisted decoding rolls the cache back"
    if getattr(generation_config, "disable_compile", False):
        return "disable_compile=True"
    compile_config = getattr(generation_config, "compile_config", None)
    device = getattr(getattr(model, "device", None), "type", None)
    if device != "cuda" and not getattr(compile_config, "_compile_all_devices", False):
        return f"the model is on {device}: generate() compiles the decode step on CUDA only"
    wanted, least = new_tokens(model_kwargs, generation_config), min_new_tokens(cache)
    if wanted is None or wanted < least:
        if cache.cuda_graphs:
            return (f"max_new_tokens={wanted} < {least} (AUTO_GRAPHED_MIN_NEW_TOKENS): too short to pay back "
                    "recording the CUDA graph")
        return (f"max_new_tokens={wanted} < {least} (AUTO_STATIC_MIN_NEW_TOKENS): too short to "
                "pay back the compile warm-up")
    return None


def min_new_tokens(cache: "RopeKVCache") -> int:
    """Fewest new tokens for which ``cache`` (``static="auto"``) goes static: the CUDA graph's threshold where its
    steps replay graphs (``cache.cuda_graphs``), else the compile's. Read at every call, so that changing either
    constant takes effect at once."""
    return AUTO_GRAPHED_MIN_NEW_TOKENS if cache.cuda_graphs else AUTO_STATIC_MIN_NEW_TOKENS


def log_decision(cache: "RopeKVCache") -> None:
    """The one INFO line a cache logs about its mode (static=True/False log none: the caller chose)."""
    mode = ("static, replaying CUDA graphs" if cache.cuda_graphs else "compiled (static)") if cache.static else "eager"
    logger.info("RopeKVCache(static='auto') decodes %s: %s.", mode, cache.static_reason.removeprefix("auto: "))
