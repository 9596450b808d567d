"""Trainer evaluation with generation, with hf_ropekv.enable: every batch gets its own fresh RopeKVCache.

Two ways users evaluate with generate():
- ``Seq2SeqTrainer`` with ``predict_with_generate=True``: it works for decoder-only models in transformers 5.x when
  the eval batches hold left-padded prompts and labels of the same length (``labels`` = the prompt, padding -100,
  so the loss forward runs too); generate() ignores ``labels``.
- a plain ``Trainer`` whose ``prediction_step`` calls ``model.generate`` (the "generate inside the eval loop" pattern).

Both run under ``accelerate`` (Trainer's Accelerator, on the CPU here). The reference is the same batches generated
with hand-made fresh caches: reusing one cache across batches would corrupt them (and RopeKVCache refuses it).
"""

from __future__ import annotations

import pytest
import torch
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainingArguments

from conftest import tiny_model
from hf_ropekv import RopeKVCache
from hf_ropekv._compat import TRANSFORMERS_VERSION
from hf_ropekv import disable, enable

OPTIONS = dict(budget=16, compress_every=4)
# generate()'s keyword for a cache object (transformers 5.24 renamed past_key_values to cache).
CACHE_KWARG = "cache" if TRANSFORMERS_VERSION.release >= (5, 24) else "past_key_values"
NEW = 20
BATCH = 3


def tiny_dataset(n: int = 6, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 12, (n,), generator=g).tolist()
    return [{"input_ids": torch.randint(2, 128, (length,), generator=g).tolist()} for length in lengths]


def collate(items: list[dict]) -> dict[str, torch.Tensor]:
    """Left-padded prompts; labels = prompt with -100 on padding (a causal-LM loss over the prompt)."""
    width = max(len(item["input_ids"]) for item in items)
    ids = torch.zeros(len(items), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, item in enumerate(items):
        length = len(item["input_ids"])
        ids[row, width - length :] = torch.tensor(item["input_ids"])
        mask[row, width - length :] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class GenerateTrainer(Trainer):
    """A plain Trainer whose evaluation generates (what a compute_metrics-over-generations loop needs)."""

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            tokens = model.generate(
                input_ids=inputs["input_ids"],
                attention_mask=inputs["attention_mask"],
                max_new_tokens=NEW,
                do_sample=False,
                pad_token_id=0,
            )
        return None, tokens, inputs["labels"]


class CacheSpy:
    """Distinct cache objects seen by model forwards, with the prompt each one was first given."""

    def __init__(self, model) -> None:
        self.caches: list = []
        self.prompts: list[torch.Tensor] = []
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None or any(c is cache for c in self.caches):
            return
        self.caches.append(cache)
        self.prompts.append(kwargs["input_ids"].clone())

    def remove(self) -> None:
        self._handle.remove()


def reference(model, data: list[dict]) -> list[torch.Tensor]:
    """Each eval batch generated with its own hand-made RopeKVCache."""
    outs = []
    for start in range(0, len(data), BATCH):
        batch = collate(data[start : start + BATCH])
        outs.append(
            model.generate(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                **{CACHE_KWARG: RopeKVCache(model, **OPTIONS)},
                max_new_tokens=NEW,
                do_sample=False,
                pad_token_id=0,
            )
        )
    return outs


def make_trainer(kind: str, model, data, tmp_path, metrics_seen: list):
    def compute_metrics(prediction):
        metrics_seen.append(prediction.predictions.shape)
        return {"rows": float(prediction.predictions.shape[0])}

    common = dict(
        output_dir=str(tmp_path),
        per_device_eval_batch_size=BATCH,
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
    )
    if kind == "seq2seq":
        args = Seq2SeqTrainingArguments(predict_with_generate=True, **common)
        cls = Seq2SeqTrainer
    else:
        args = TrainingArguments(**common)
        cls = GenerateTrainer
    return cls(model=model, args=args, eval_dataset=data, data_collator=collate, compute_metrics=compute_metrics)


@pytest.mark.parametrize("kind", ["seq2seq", "trainer"])
def test_eval_with_generation_gets_a_fresh_cache_per_batch(kind: str, tmp_path) -> None:
    model = tiny_model("llama")
    data = tiny_dataset()
    want = reference(model, data)

    metrics_seen: list = []
    trainer = make_trainer(kind, model, data, tmp_path, metrics_seen)
    enable(model, **OPTIONS)
    spy = CacheSpy(model)
    try:
        gen_kwargs = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0) if kind == "seq2seq" else {}
        result = trainer.predict(data, **gen_kwargs)
    finally:
        spy.remove()
        disable(model)

    # One fresh RopeKVCache per batch, each fed exactly its batch's prompt, each evicting.
    batches = [collate(data[s : s + BATCH]) for s in range(0, len(data), BATCH)]
    assert [type(c) for c in spy.caches] == [RopeKVCache] * len(batches)
    assert len({id(c) for c in spy.caches}) == len(batches)
    for cache, prompt, batch in zip(spy.caches, spy.prompts, batches):
        assert torch.equal(prompt, batch["input_ids"])
        assert cache.num_compactions > 0 and cache.options.budget == OPTIONS["budget"]

    # The predictions are the hand-made fresh-cache generations (the eval loop pads them to a common width).
    predictions = torch.as_tensor(result.predictions)
    row = 0
    for out in want:
        got = predictions[row : row + out.shape[0]]
        assert torch.equal(got[:, : out.shape[1]], out)
        assert bool(((got[:, out.shape[1] :] == -100) | (got[:, out.shape[1] :] == 0)).all())
        row += out.shape[0]
    assert row == predictions.shape[0] == len(data)
    assert metrics_seen and result.metrics["test_rows"] == len(data)


def test_evaluate_runs_with_enabled_cache(tmp_path) -> None:
    """Seq2SeqTrainer.evaluate (loss + generation + compute_metrics) completes with the cache enabled."""
    model = tiny_model("llama")
    model.generation_config.max_new_tokens = 8
    model.generation_config.pad_token_id = 0
    data = tiny_dataset(n=4, seed=1)
    metrics_seen: list = []
    trainer = make_trainer("seq2seq", model, data, tmp_path, metrics_seen)
    enable(model, budget=12, compress_every=2)
    spy = CacheSpy(model)
    try:
        metrics = trainer.evaluate()
    finally:
        spy.remove()
        disable(model)
    assert "eval_loss" in metrics and metrics["eval_rows"] == len(data)
    assert [type(c) for c in spy.caches] == [RopeKVCache, RopeKVCache]
