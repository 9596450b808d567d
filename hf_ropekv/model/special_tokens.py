"""The special token ids a model's ``generate()`` works with, read from its generation config."""

from __future__ import annotations

from typing import Any, Iterable

from torch import nn


def token_ids(*values: Any) -> list[int]:
    """The token ids in ``values`` (each an id, a list of ids, or ``None``), in order and without repeats."""
    found: list[int] = []
    for value in values:
        for token in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(token, int) and not isinstance(token, bool) and token not in found:
                found.append(token)
    return found


def generation_token_ids(model: nn.Module, fields: Iterable[str]) -> list[int]:
    """The ids of ``fields`` (``"pad_token_id"``, ``"eos_token_id"``, ...) in ``model.generation_config``."""
    config = getattr(model, "generation_config", None)
    return token_ids(*(getattr(config, field, None) for field in fields))
