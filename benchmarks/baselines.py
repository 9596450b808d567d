"""Caches RopeKVCache is compared with, besides transformers' own ``DynamicCache``.

- :class:`GatherRebindCache`: budgeted eviction the way the TriAttention / R-KV reference implementations and
  kvpress do it on a ``DynamicCache``: every ``compress_every`` tokens, pick the slots to keep and
  ``gather`` them **into new tensors** that replace the old ones (gather-and-rebind); appends stay
  ``torch.cat`` (a new tensor per layer per step). Keys are ranked by key norm (kvpress' ``KnormPress``): the
  baseline is about memory and copies, not about which tokens survive.
- :func:`make_quantized_cache`: transformers' ``QuantizedCache`` with the optimum-quanto backend (int4 KV,
  residual window of 128 tokens in full precision), when optimum-quanto is installed.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer


class GatherRebindLayer(DynamicLayer):
    """A ``DynamicLayer`` that evicts to ``budget`` slots by gathering survivors into fresh tensors."""

    def __init__(self, budget: int, compress_every: int) -> None:
        super().__init__()
        self.budget = budget
        self.compress_every = compress_every
        self.tokens_seen = 0
        self.num_evictions = 0

    @property
    def kept(self) -> int:
        return 0 if not self.is_initialized or self.keys is None or self.keys.ndim < 4 else self.keys.shape[-2]

    def planned_kept(self, query_length: int) -> int:
        kept = self.kept
        if kept + query_length <= self.budget + self.compress_every:
            return kept
        return max(0, min(kept, self.budget - max(0, query_length - self.compress_every)))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        target = self.planned_kept(key_states.shape[-2])
        if target < self.kept:
            scores = torch.linalg.vector_norm(self.keys.float(), dim=-1).neg()  # [B, H, K]: small norm kept
            index = scores.topk(target, dim=-1, sorted=False).indices.sort(dim=-1).values
            gather = index.unsqueeze(-1).expand(-1, -1, -1, self.keys.shape[-1])
            self.keys = self.keys.gather(2, gather)  # new tensors; the old ones are freed when rebound
            self.values = self.values.gather(2, gather)
            self.num_evictions += 1
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        self.tokens_seen += key_states.shape[-2]
        return keys, values

    # A sliding-window layer's mask geometry (as transformers' sliding layers report it): the kept slots are the
    # rightmost mask columns, and the evicted tokens are an offset before them.
    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        kept = self.planned_kept(query_length)
        return kept + query_length, self.tokens_seen - kept

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.tokens_seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        super().reset()
        self.tokens_seen = 0

    def crop(self, *args, **kwargs) -> None:
        raise NotImplementedError("GatherRebindCache cannot crop")


class GatherRebindCache(Cache):
    """Budgeted ``DynamicCache`` that evicts by gather-and-rebind every ``compress_every`` tokens."""

    def __init__(self, config, budget: int, compress_every: int = 128) -> None:
        config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        layers = [GatherRebindLayer(budget, compress_every) for _ in range(config.num_hidden_layers)]
        super().__init__(layers=layers)
        self.budget = budget
        self.compress_every = compress_every

    @property
    def tokens_kept(self) -> int:
        return self.layers[0].kept

    @property
    def num_evictions(self) -> int:
        return self.layers[0].num_evictions


# ---------------------------------------------------------------------------------------------- quanto
def quanto_available() -> bool:
    try:
        import optimum.quanto  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available here"
        return False
    return True


def _unpack_uint8(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """optimum-quanto's own pure-PyTorch ``unpack`` (its ``quanto::unpack`` default implementation)."""
    values_per_item = 8 // bits
    parts = [(packed & (2 ** (bits * (i + 1)) - 1)) >> (bits * i) for i in range(values_per_item)]
    return torch.cat(parts).to(torch.uint8)


def use_quanto_python_unpack() -> list[str]:
    """Serve quanto's ``unpack`` from PyTorch ops instead of its C++/CUDA extensions, which are compiled on first
    use (minutes with nvcc for the CUDA one, every fresh machine). Only extensions not yet loaded are touched.
    Everything else quanto does is unchanged. Returns the extensions that were redirected.
    """
    try:
        from optimum.quanto.library.extensions import get_extension
    except Exception:  # noqa: BLE001 - no quanto, or a layout this shim does not know: leave it alone
        return []
    redirected = []
    for name in ("quanto_cpp", "quanto_cuda"):
        try:
            ext = get_extension(name)
        except KeyError:
            continue
        if getattr(ext, "_lib", None) is None:
            ext._lib = types.SimpleNamespace(unpack=_unpack_uint8)
            redirected.append(name)
    return redirected


def make_quantized_cache(config, nbits: int = 4) -> Any:
    """transformers' ``QuantizedCache`` (optimum-quanto backend, int``nbits``, residual 128, group 64)."""
    from transformers import QuantizedCache

    return QuantizedCache(backend="quanto", config=config, nbits=nbits)
