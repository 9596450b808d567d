"""Chunked long-document perplexity: a regression check of eviction under teacher forcing.

A document of ``tokens`` tokens is fed through one cache in chunks of ``chunk`` tokens (a long prompt read in
pieces); every token is scored against the next. Teacher forcing hides failures that free-running generation shows
(DESIGN.md §6), so this cell guards regressions and never judges a policy alone.

The documents are ``benchmarks/data/documents.json``: four pages of the Python 3.11 documentation (53 KB,
committed so that both machines read the same text).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from common import cache_kwarg

DOCUMENTS = Path(__file__).resolve().parent / "data" / "documents.json"


def load_documents() -> list[dict[str, str]]:
    """``[{"name", "text"}]`` of the committed documents, in file order."""
    return json.loads(DOCUMENTS.read_text())["documents"]


def document_ids(tokenizer: Any, text: str, tokens: int) -> list[int]:
    """The first ``tokens`` token ids of ``text`` (no special tokens); a ValueError if it is shorter."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if len(ids) < tokens:
        raise ValueError(f"the document holds {len(ids)} tokens, fewer than the {tokens} asked for")
    return ids[:tokens]


@torch.no_grad()
def chunked_nll(model: torch.nn.Module, ids: list[int], cache: Any, chunk: int) -> torch.Tensor:
    """Negative log-likelihood of tokens 1..T-1 of ``ids``, fed in chunks through ``cache`` (``None``: a fresh
    ``DynamicCache``, the full cache); float32 ``[T - 1]`` on the CPU."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config) if cache is None else cache
    tokens = torch.tensor([ids], device=device)
    nll = []
    for start in range(0, len(ids), chunk):
        piece = tokens[:, start:start + chunk]
        logits = model(input_ids=piece, use_cache=True, **{cache_kwarg(model): cache}).logits[0].float()
        targets = tokens[0, start + 1:start + 1 + piece.shape[1]]
        logp = torch.log_softmax(logits[: len(targets)], dim=-1)
        nll.append(-logp.gather(-1, targets[:, None])[:, 0].cpu())
    return torch.cat(nll)


def perplexity(nll: torch.Tensor) -> float:
    return math.exp(float(nll.mean()))
