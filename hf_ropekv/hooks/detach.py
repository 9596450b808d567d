"""``hf_ropekv.detach(model)``: take everything hf_ropekv put on a model off it, at once.

What goes: :func:`~hf_ropekv.enable`'s wrappers, the forward hooks and attention wrappers of every cache built
from the model (static caches' kept hooks included), the ``prepare_inputs_for_generation`` /
``get_compiled_call`` wrappers, the grouped-query attention implementation a static cache selected, the rotary
pass-through (once no other model needs it), the static buffers pooled for the model, and what a copied model
brought along from its original. Caches built from the model before refuse further use with an error naming
``detach``. Idempotent; a later ``RopeKVCache(model, ...)`` or ``enable`` installs everything again.
"""

from __future__ import annotations

from typing import TypeVar

from torch import nn

from ..model.attention import restore_attention
from ..model.capture import _CopiedForward
from ..storage.buffers import release_static_buffers
from .generate_methods import _ModelMethod
from .shared_hooks import SharedHooks, _drop_copied_hooks
from .enable import _generating_model, disable

ModelT = TypeVar("ModelT", bound=nn.Module)

__all__ = ["detach"]


def detach(model: ModelT) -> ModelT:
    """Remove every hook, wrapper and patch hf_ropekv put on ``model``; returns ``model``. A no-op when none.

    Raises nothing for a model hf_ropekv never touched. Caches built from ``model`` before raise a
    ``RuntimeError`` naming ``detach`` when used again.
    """
    target = _generating_model(model)
    disable(target)
    hooks = SharedHooks._BY_MODEL.get(target)
    if hooks is not None:
        hooks.detach_model()
    for name, value in list(target.__dict__.items()):
        if isinstance(value, _ModelMethod):  # prepare_inputs_for_generation / get_compiled_call wrappers
            if value.previous is None:
                delattr(target, name)
            else:
                setattr(target, name, value.previous)
    _drop_copied_hooks(target)
    restore_attention(target, "sdpa")  # a copy may have come switched to grouped_sdpa by its original's hooks
    for module in target.modules():
        copied = getattr(module.__dict__.get("forward"), "__self__", None)
        if isinstance(copied, _CopiedForward):  # a copied model's pass-through (see _Frame.__reduce__)
            copied.restore()
    release_static_buffers(target)
    return model
