"""Calibrate the RoPE scorer's query statistics on ordinary text or on the model's answers to prompts.

    stats = hf_ropekv.calibrate(model, tokenizer, [open("book.txt").read()])
    stats = hf_ropekv.calibrate(model, tokenizer, prompts=["Solve: ...", ...], max_new_tokens=256)
    stats.save("model.ropekv.safetensors")
"""

from __future__ import annotations

from typing import Any, Sequence, Union

import torch
from torch import nn
from transformers.utils import logging

from ..model.query_hooks import query_capture
from ..model.geometry import describe
from .fingerprint import model_source, weights_fingerprint
from .frequency_stats import FrequencyAccumulator, FrequencyStats

logger = logging.get_logger(__name__)

Texts = Union[str, Sequence[str], torch.Tensor, Sequence[int], Sequence[Sequence[int]]]

DEFAULT_MAX_TOKENS = 32768
DEFAULT_CHUNK_TOKENS = 4096
DEFAULT_ANSWER_BATCH = 16


def calibrate(model: nn.Module, tokenizer: Any, texts: Texts | None = None, max_tokens: int = DEFAULT_MAX_TOKENS,
              chunk_tokens: int = DEFAULT_CHUNK_TOKENS, source: str | None = None, progress: bool = True, *,
              prompts: Sequence[str] | None = None, max_new_tokens: int = 256,
              batch_size: int = DEFAULT_ANSWER_BATCH) -> "FrequencyStats":
    """Average the pre-RoPE queries of ``model`` over ``texts`` (or ``prompts`` with the model's answers).

    Args:
        model: a decoder-only RoPE model (any dtype, device or ``device_map``; weight-quantized works).
        tokenizer: its tokenizer; may be ``None`` when ``texts`` are token ids.
        texts: a string, a list of strings (each tokenized on its own, with special tokens), or token ids: a
            1-D / 2-D ``input_ids`` tensor (rows are unpadded sequences), a list of ids or a list of id lists.
        max_tokens: at most this many tokens are used in total.
        chunk_tokens: at most this many tokens (batch x padded length) per forward.
        source: description of the text stored in the statistics (default: a summary of ``texts``).
        progress: show a tqdm progress bar.
        prompts: instead of ``texts``: the model answers each (greedy, ``DynamicCache``, in the chat template
            when the tokenizer has one) and the statistics cover each prompt with its answer.
        max_new_tokens: the longest answer per prompt.
        batch_size: prompts answered together (left-padded); each answer is cut after its end-of-sequence token.

    Returns:
        float32 :class:`FrequencyStats` covering every decoder layer.
    """
    if max_tokens < 1 or chunk_tokens < 1:
        raise ValueError(f"max_tokens and chunk_tokens must be positive, got {max_tokens} and {chunk_tokens}.")
    if (texts is None) == (prompts is None):
        raise ValueError("calibrate() takes either texts (ordinary text or token ids) or prompts= (the model "
                         "answers them), not both and not neither.")
    geometry = describe(model)
    if prompts is not None:
        texts = answered_prompts(model, tokenizer, prompts, max_new_tokens, max_tokens, progress, batch_size)
        source = source or f"{len(texts)} prompt(s) with the model's greedy answers"
    sequences, kind = _token_sequences(tokenizer, texts, max_tokens)
    pieces = [seq[i : i + chunk_tokens] for seq in sequences for i in range(0, len(seq), chunk_tokens)]
    total = sum(len(p) for p in pieces)
    if total == 0:
        raise ValueError("calibrate() got no tokens: pass non-empty text (or input_ids).")
    pad_id = int(getattr(tokenizer, "pad_token_id", None) or 0)
    device = _input_device(model)
    accumulator, current_mask = FrequencyAccumulator(geometry), {}
    was_training = model.training
    model.eval()  # dropout off: the statistics are those of inference
    try:
        with torch.no_grad(), query_capture(
            model, geometry, lambda layer_idx, q: accumulator.add(layer_idx, q, current_mask.get("mask"))
        ), logging.tqdm(total=total, unit="tok", desc="hf_ropekv calibration", disable=not progress) as bar:
            for input_ids, attention_mask in _batches(pieces, chunk_tokens, pad_id):
                current_mask["mask"] = attention_mask.bool() if not bool(attention_mask.all()) else None
                model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False)
                bar.update(int(attention_mask.sum()))
    finally:
        model.train(was_training)
    source = f"{kind}, {total} tokens" if source is None else source
    stats = accumulator.to_stats(source=source)
    fingerprint = weights_fingerprint(model)
    if fingerprint is not None:  # which weights: checked when the statistics are loaded
        stats.metadata.update(weights_fingerprint=fingerprint, weights_source=model_source(model))
    logger.info("hf_ropekv: calibrated %s on %d tokens (%s).", geometry.model_type, stats.tokens, source)
    return stats


def answered_prompts(model: nn.Module, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int,
                     max_tokens: int = DEFAULT_MAX_TOKENS, progress: bool = False,
                     batch_size: int = DEFAULT_ANSWER_BATCH) -> list[list[int]]:
    """Token ids of each prompt followed by the model's greedy answer (cut after its end-of-sequence token),
    ``batch_size`` prompts per ``generate()``, until ``max_tokens`` tokens are there."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts \
            or not all(isinstance(p, str) for p in prompts):
        raise TypeError("prompts must be a non-empty list of strings (one user message each).")
    if tokenizer is None:
        raise ValueError("calibrate(prompts=...) needs the tokenizer, to tokenize the prompts.")
    for name, value in (("max_new_tokens", max_new_tokens), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int; got {value!r}.")
    chat = getattr(tokenizer, "chat_template", None) is not None
    pad_id = getattr(tokenizer, "pad_token_id", None)
    pad_id = getattr(tokenizer, "eos_token_id", None) if pad_id is None else pad_id
    eos_ids = _eos_ids(model, tokenizer)
    device = _input_device(model)
    sequences, seen = [], 0
    was_training = model.training
    model.eval()
    try:
        with logging.tqdm(total=len(prompts), unit="prompt", desc="hf_ropekv answers", disable=not progress) as bar:
            for first in range(0, len(prompts), batch_size):
                if seen >= max_tokens:
                    break
                batch = [_prompt_ids(tokenizer, prompt, chat) for prompt in prompts[first : first + batch_size]]
                for prompt_ids, answer in zip(batch, _answer(model, batch, max_new_tokens, pad_id, eos_ids, device)):
                    end = next((i + 1 for i, token in enumerate(answer) if token in eos_ids), len(answer))
                    sequences.append(prompt_ids + answer[:end])  # what follows its end is a finished row's filler
                    seen += len(sequences[-1])
                bar.update(len(batch))
    finally:
        model.train(was_training)
    return sequences


def _prompt_ids(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_dict=True)["input_ids"]
    else:
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    return [int(t) for t in ids]


def _answer(model: nn.Module, batch: list[list[int]], max_new_tokens: int, pad_id: int | None,
            eos_ids: list[int], device: torch.device) -> list[list[int]]:
    """Greedy answers of left-padded ``batch`` (each row's new tokens, including the filler after its end)."""
    from transformers import DynamicCache

    from .._compat import cache_kwarg

    input_ids, attention_mask = _padded(batch, 0 if pad_id is None else int(pad_id), left=True)
    # An explicit DynamicCache: an hf_ropekv-enabled model must not answer with an evicting cache.
    kwargs: dict[str, Any] = {cache_kwarg(model): DynamicCache(config=model.config)}
    if eos_ids:  # stop where answered_prompts cuts
        kwargs["eos_token_id"] = eos_ids
    with torch.no_grad():
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                             do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad_id, **kwargs)
    return out[:, input_ids.shape[1]:].tolist()


def _eos_ids(model: nn.Module, tokenizer: Any) -> list[int]:
    """The generation config's end-of-sequence ids, then the tokenizer's (a chat end-of-turn marker may be only
    there), without repeats."""
    found: list[int] = []
    for value in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                  getattr(tokenizer, "eos_token_id", None)):
        for token in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(token, int) and not isinstance(token, bool) and token not in found:
                found.append(token)
    return found


def _token_sequences(tokenizer: Any, texts: Texts, max_tokens: int) -> tuple[list[list[int]], str]:
    """Token id lists, cut to ``max_tokens`` in total, and a short description of where they came from."""
    if isinstance(texts, str):
        texts = [texts]
    if isinstance(texts, torch.Tensor):
        ids = texts.detach().cpu()
        rows, kind = ([ids.tolist()] if ids.ndim == 1 else ids.tolist()), "input_ids"
    elif isinstance(texts, Sequence) and texts and all(isinstance(t, str) for t in texts):
        if tokenizer is None:
            raise ValueError("calibrate() needs a tokenizer to tokenize text; pass one, or pass token ids instead.")
        rows, kind, seen = [], f"{len(texts)} text(s)", 0
        for text in texts:  # tokenize lazily: stop once max_tokens are there
            if seen >= max_tokens:
                break
            rows.append(tokenizer(text, add_special_tokens=True)["input_ids"])
            seen += len(rows[-1])
    elif isinstance(texts, Sequence) and texts and isinstance(texts[0], int):
        rows, kind = [list(texts)], "input_ids"
    elif isinstance(texts, Sequence) and texts and isinstance(texts[0], (Sequence, torch.Tensor)):
        rows, kind = [list(row) for row in texts], "input_ids"
    else:
        raise TypeError("texts must be a non-empty string, list of strings, input_ids tensor, list of ids or list of "
                        f"id lists; got {type(texts).__name__}.")
    sequences, budget = [], max_tokens
    for row in rows:
        row = [int(t) for t in row[:budget]]
        if row:
            sequences.append(row)
            budget -= len(row)
        if budget <= 0:
            break
    return sequences, kind


def _batches(pieces: list[list[int]], chunk_tokens: int, pad_id: int):
    """Right-padded ``(input_ids, attention_mask)`` batches of at most ``chunk_tokens`` padded tokens each (right
    padding leaves the real tokens' positions and, under the causal mask, their queries unchanged)."""
    order = sorted(pieces, key=len, reverse=True)  # similar lengths together: little padding
    start = 0
    while start < len(order):
        group = order[start : start + max(1, chunk_tokens // len(order[start]))]
        start += len(group)
        yield _padded(group, pad_id, left=False)


def _padded(rows: list[list[int]], pad_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``(input_ids, attention_mask)`` of ``rows`` padded to the longest, on the left or the right."""
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        input_ids[i, span] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, span] = 1
    return input_ids, attention_mask


def _input_device(model: nn.Module) -> torch.device:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None and getattr(embeddings, "weight", None) is not None:
        return embeddings.weight.device
    return next(model.parameters()).device
