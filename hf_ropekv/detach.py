"""``hf_ropekv.detach(model)``: take everything hf_ropekv put on a model off it, at once (enable's wrappers, every
cache's hooks and wrappers, the grouped-query attention, the rotary pass-through, pooled static buffers, and what a
copied model brought along). Caches built before refuse further use. Idempotent."""

from __future__ import annotations

from typing import TypeVar

from torch import nn

from .adapter.generate_methods import GENERATE_WRAPPERS
from .adapter.shared_hooks import SharedHooks, _drop_copied_hooks
from .enable import _generating_model, disable
from .model.attention import restore_attention
from .model.capture import _CopiedForward
from .storage.buffers import BufferPool

ModelT = TypeVar("ModelT", bound=nn.Module)

__all__ = ["detach"]


def detach(model: ModelT) -> ModelT:
    """Remove every hook, wrapper and patch hf_ropekv put on ``model``; returns ``model``. A no-op when none."""
    target = _generating_model(model)
    disable(target)
    hooks = SharedHooks._BY_MODEL.get(target)
    if hooks is not None:
        hooks.detach_model()
    for wrapper in GENERATE_WRAPPERS:  # a copy's, made by its original's caches
        wrapper.uninstall(target)
    _drop_copied_hooks(target)
    restore_attention(target, "sdpa")  # a copy may have come switched to grouped_sdpa by its original's hooks
    for module in target.modules():
        copied = getattr(module.__dict__.get("forward"), "__self__", None)
        if isinstance(copied, _CopiedForward):  # a copied model's pass-through (see _Frame.__reduce__)
            copied.restore()
    BufferPool._BY_MODEL.pop(target, None)
    return model
