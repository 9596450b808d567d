#!/usr/bin/env python
"""RopeKVCache on a model split across two GPUs by ``from_pretrained(..., device_map="auto")``.

Builds a Qwen3-1.7B-shaped model with random bf16 weights on cuda:0, saves it to a temporary folder and reloads
it with ``device_map="auto"`` (accelerate balances the layers over cuda:0 and cuda:1). Then:

1. **Exactness, nothing evicted.** Greedy generation of a left-padded batch with ``RopeKVCache(budget=None)``,
   with ``hf_ropekv.enable(model, budget=None)`` and with ``DynamicCache`` on the split model, and with
   ``RopeKVCache(budget=None)`` on one GPU, against ``DynamicCache`` on one GPU (loaded the same way). In float32
   every run must give exactly the reference's tokens. In bf16 a divergence is reported with the reference's
   top-2 logit margin where it happens, not failed: random weights give exact bf16 ties, which flip even
   between two ``DynamicCache`` runs (split and single GPU).
2. **Bounded memory, with eviction.** A long greedy generation with ``DynamicCache`` and with
   ``RopeKVCache(budget)`` on the split model: per GPU, the peak of ``torch.cuda.max_memory_allocated`` above the
   weights, and the bytes each cache holds on that GPU. Every layer's pages must sit on that layer's GPU, the
   RopeKVCache bytes on each GPU must stay within the budget bound, and its peak below DynamicCache's.

Prints a table and exits non-zero when a check fails. About 2-3 minutes on a 2xH200 host.

    pip install --no-deps -e .            # or run from a checkout: kernels/ is mapped by hand
    python benchmarks/device_map_check.py
    python benchmarks/device_map_check.py --dry-run        # CPU, tiny model, seconds (logic check)
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from common import padded_prompts

REPO = Path(__file__).resolve().parents[1]

# Qwen3-1.7B's shape (its real config ties the embeddings; untied here: same cache behaviour, simpler split).
QWEN3_1_7B = dict(
    hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
)
TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=256, max_position_embeddings=4096, rope_theta=10_000.0, rms_norm_eps=1e-6,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny model on the CPU (two 'cpu' halves)")
    p.add_argument("--batch", type=int, default=None, help="rows (default 8; dry run 3)")
    p.add_argument("--prompt-len", type=int, default=None, help="longest prompt (default 256; dry run 12)")
    p.add_argument("--exact-new-tokens", type=int, default=None, help="check 1 length (default 64; dry run 16)")
    p.add_argument("--new-tokens", type=int, default=None, help="check 2 length (default 1536; dry run 48)")
    p.add_argument("--budget", type=int, default=None, help="check 2 budget (default 512; dry run 24)")
    p.add_argument("--compress-every", type=int, default=None, help="(default 128; dry run 8)")
    p.add_argument("--page-size", type=int, default=None, help="(default 64; dry run 8)")
    p.add_argument("--workdir", default=None, help="where the random model is saved (default: a temp folder)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    dry = args.dry_run
    for name, full, tiny in [
        ("batch", 8, 3), ("prompt_len", 256, 12), ("exact_new_tokens", 64, 16), ("new_tokens", 1536, 48),
        ("budget", 512, 24), ("compress_every", 128, 8), ("page_size", 64, 8),
    ]:
        if getattr(args, name) is None:
            setattr(args, name, tiny if dry else full)
    return args


# --------------------------------------------------------------------------------------------- helpers


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def generate(model, ids, mask, new_tokens: int, cache=None, logits: bool = False):
    """Greedy tokens; with ``logits``, a dict of ``sequences`` and stacked float ``logits`` (on the CPU)."""
    from hf_ropekv._compat import cache_kwarg

    extra = {cache_kwarg(model): cache} if cache is not None else {}
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=0, return_dict_in_generate=logits, output_logits=logits, **extra,
        )
    if logits:
        return dict(sequences=out.sequences.cpu(), logits=torch.stack([x.float().cpu() for x in out.logits], 1))
    return out


def compare(reference: dict, run: dict) -> dict:
    """Identical greedy tokens? If not: where they first part, and how close the reference's top two were there.

    ``max_logit_diff`` is taken over the steps up to the first divergence (after it the inputs differ).
    """
    ref_seq, seq = reference["sequences"], run["sequences"]
    new = ref_seq.shape[1] - reference["logits"].shape[1]
    differs = (ref_seq != seq)[:, new:]
    if not differs.any():
        diff = (reference["logits"] - run["logits"]).abs().max().item()
        return dict(identical=True, max_logit_diff=diff, summary=f"identical (max |dlogit| {diff:.2e})")
    step = int(differs.any(0).nonzero()[0])
    row = int(differs[:, step].nonzero()[0])
    top2 = reference["logits"][row, step].topk(2).values
    margin = (top2[0] - top2[1]).item()
    diff = (reference["logits"][:, : step + 1] - run["logits"][:, : step + 1]).abs().max().item()
    rows = int(differs.any(-1).sum())
    return dict(
        identical=False, rows_differing=rows, first_step=step, row=row, top2_margin=margin, max_logit_diff=diff,
        summary=f"DIFFERENT in {rows} rows from step {step} (row {row}: reference top-2 margin {margin:.3g}, "
                f"max |dlogit| up to there {diff:.3g})",
    )


def cache_bytes_by_device(cache) -> dict[str, int]:
    """Bytes of the cache's tensors on each device (RopeKVCache pages or DynamicCache layers)."""
    out: dict[str, int] = {}
    for layer in cache.layers:
        storage = getattr(layer, "storage", None)
        if storage is not None:
            if storage.keys is not None:
                key = str(storage.keys.device)
                out[key] = out.get(key, 0) + storage.bytes_held
        elif getattr(layer, "keys", None) is not None and layer.keys.numel():
            key = str(layer.keys.device)
            out[key] = out.get(key, 0) + 2 * layer.keys.numel() * layer.keys.element_size()
    return out


def layer_devices(model) -> list[torch.device]:
    """The device each decoder layer computes on (its execution device under accelerate)."""
    devices = []
    for layer in model.model.layers:
        hook = getattr(layer, "_hf_hook", None)
        execution = getattr(hook, "execution_device", None)
        if execution is None:
            execution = next(layer.parameters()).device
        devices.append(torch.device(execution) if not isinstance(execution, torch.device) else execution)
    return devices


def misplaced_layers(cache, per_layer: list[torch.device]) -> list[int]:
    """Indices of RopeKVCache layers whose pages are not on the device their decoder layer computes on."""
    return [
        i for i, layer in enumerate(cache.layers)
        if getattr(layer, "storage", None) is not None and layer.storage.keys.device != per_layer[i]
    ]


class PeakMemory:
    """Per-GPU peak of allocated memory above what was allocated at the start (the weights)."""

    def __init__(self, devices: list[torch.device]) -> None:
        self.devices = [d for d in devices if d.type == "cuda"]

    def __enter__(self) -> "PeakMemory":
        gc.collect()
        self.base = {}
        for d in self.devices:
            torch.cuda.synchronize(d)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(d)
            self.base[str(d)] = torch.cuda.memory_allocated(d)
        return self

    def __exit__(self, *exc) -> None:
        self.peak = {}
        for d in self.devices:
            torch.cuda.synchronize(d)
            self.peak[str(d)] = torch.cuda.max_memory_allocated(d) - self.base[str(d)]


# --------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import import_hf_ropekv

    hf_ropekv = import_hf_ropekv()
    from transformers import AutoModelForCausalLM, DynamicCache, Qwen3Config

    from hf_ropekv import RopeKVCache
    from hf_ropekv.hooks.enable import disable, enable

    if args.dry_run:
        devices = [torch.device("cpu"), torch.device("cpu")]
        dtype = torch.float32
    else:
        if torch.cuda.device_count() < 2:
            log(f"needs two GPUs, found {torch.cuda.device_count()} (use --dry-run on a CPU)")
            return 2
        devices = [torch.device("cuda:0"), torch.device("cuda:1")]
        dtype = torch.bfloat16
    import transformers

    log(f"torch {torch.__version__}, transformers {transformers.__version__}, hf_ropekv {hf_ropekv.__version__}, "
        f"devices {[str(d) for d in devices]}" + (f" ({torch.cuda.get_device_name(0)})" if not args.dry_run else ""))
    t_start = time.perf_counter()
    failures: list[str] = []
    results: dict[str, Any] = {"args": vars(args)}

    # ---- build a random model on the first device, save it
    shape = TINY if args.dry_run else QWEN3_1_7B
    config = Qwen3Config(**shape, tie_word_embeddings=False, pad_token_id=0, bos_token_id=None, eos_token_id=None,
                         use_sliding_window=False)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ropekv_device_map_"))
    if args.workdir is None:
        import atexit
        import shutil

        atexit.register(shutil.rmtree, workdir, True)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(devices[0]):  # initialise on the GPU: seconds instead of a minute on the CPU
        single = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    single.to(devices[0])
    single.save_pretrained(workdir / "model")
    n_params = sum(p.numel() for p in single.parameters())
    log(f"built {n_params / 1e6:.1f}M-parameter Qwen3-shaped model on {devices[0]}, saved to {workdir / 'model'} "
        f"({time.perf_counter() - t0:.0f} s)")

    vocab = config.vocab_size
    del single
    gc.collect()
    if not args.dry_run:
        torch.cuda.empty_cache()

    def load(device_map: Any, load_dtype: torch.dtype):
        # The single-device reference is loaded by the same path as the split model: a model initialised on the
        # GPU computes RoPE's inv_freq there, and one ulp of difference flips near-tied tokens of random weights.
        return AutoModelForCausalLM.from_pretrained(
            workdir / "model", device_map=device_map, dtype=load_dtype, attn_implementation="sdpa"
        ).eval()

    if args.dry_run:
        device_map: Any = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
        device_map.update({f"model.layers.{i}": "cpu" for i in range(config.num_hidden_layers)})
    else:
        device_map = "auto"

    # ---- check 1: exact tokens, nothing evicted, in float32 (must be identical) and in the model's dtype
    results["exact"] = {}
    for check_dtype in dict.fromkeys([torch.float32, dtype]):
        name_dtype = str(check_dtype).removeprefix("torch.")
        t0 = time.perf_counter()
        single = load({"": devices[0]}, check_dtype)
        ids, mask = padded_prompts(args.batch, args.prompt_len, vocab, devices[0])
        reference = generate(single, ids, mask, args.exact_new_tokens, DynamicCache(config=single.config), logits=True)
        runs = {"single device, RopeKVCache(budget=None)": generate(
            single, ids, mask, args.exact_new_tokens, RopeKVCache(single, budget=None), logits=True)}
        del single
        gc.collect()
        if not args.dry_run:
            torch.cuda.empty_cache()
        model = load(device_map, check_dtype)
        per_layer = layer_devices(model)
        split = {str(d): sum(1 for x in per_layer if x == d) for d in dict.fromkeys(per_layer)}
        if not args.dry_run and len(split) < 2:
            failures.append(f"device_map='auto' did not split the layers: {split}")
        input_device = model.get_input_embeddings().weight.device
        ids, mask = ids.to(input_device), mask.to(input_device)
        runs["split, DynamicCache"] = generate(
            model, ids, mask, args.exact_new_tokens, DynamicCache(config=model.config), logits=True)
        rope_cache = RopeKVCache(model, budget=None)
        runs["split, RopeKVCache(budget=None)"] = generate(model, ids, mask, args.exact_new_tokens, rope_cache, logits=True)
        enable(model, budget=None)
        try:
            runs["split, enable(budget=None)"] = generate(model, ids, mask, args.exact_new_tokens, logits=True)
        finally:
            disable(model)
        wrong = misplaced_layers(rope_cache, per_layer)
        if wrong:
            failures.append(f"pages of layers {wrong} are not on their layer's device")
        verdicts = {name: compare(reference, run) for name, run in runs.items()}
        results["exact"][name_dtype] = verdicts
        for name, verdict in verdicts.items():
            # float32 must be identical everywhere. In bf16 it cannot be required: on 2xH200 (2026-11-29) even
            # DynamicCache on the split model parted from the one-GPU run, at a step where the reference's top
            # two logits were tied exactly; those runs are reported with their logit gaps, not failed.
            if not verdict["identical"] and check_dtype == torch.float32:
                failures.append(f"{name_dtype}, {name}: {verdict['summary']}")
        log(f"check 1 ({name_dtype}, nothing evicted, layers per device {split}):\n    "
            + "\n    ".join(f"{k}: {v['summary']}" for k, v in verdicts.items())
            + f"\n    pages on their layer's device: {'yes' if not wrong else 'NO'} ({time.perf_counter() - t0:.0f} s)")
        del rope_cache, runs, reference
        gc.collect()
        if check_dtype != dtype:
            del model
            gc.collect()
            if not args.dry_run:
                torch.cuda.empty_cache()
    results["layers_per_device"] = split

    # ---- check 2: long generation, per-device memory
    runs: dict[str, dict] = {}
    for name in ("DynamicCache", "RopeKVCache"):
        t0 = time.perf_counter()
        if name == "DynamicCache":
            cache = DynamicCache(config=model.config)
        else:
            cache = RopeKVCache(model, budget=args.budget, compress_every=args.compress_every, page_size=args.page_size)
        with PeakMemory(list(dict.fromkeys(per_layer))) as mem:
            out = generate(model, ids, mask, args.new_tokens, cache)
        seconds = time.perf_counter() - t0
        runs[name] = dict(
            seconds=seconds,
            tokens_per_s=args.batch * args.new_tokens / seconds,
            peak=getattr(mem, "peak", {}),
            cache_bytes=cache_bytes_by_device(cache),
            tokens_seen=out.shape[1],
        )
        if name == "RopeKVCache":
            runs[name].update(kept=cache.tokens_kept, compactions=cache.num_compactions)
            wrong = misplaced_layers(cache, per_layer)
            if wrong:
                failures.append(f"check 2: pages of layers {wrong} are not on their layer's device")
        log(f"check 2, {name}: {args.batch} rows, prompt {args.prompt_len} + {args.new_tokens} new tokens "
            f"({seconds:.0f} s)")
        del cache, out
        gc.collect()
    results["long"] = runs

    # The bound: every full-attention layer holds at most budget + compress_every slots, rounded up to pages.
    capacity = -(-(args.budget + args.compress_every) // args.page_size) * args.page_size
    per_slot = args.batch * config.num_key_value_heads * (2 * config.head_dim * torch.empty((), dtype=dtype).element_size() + 8)
    print()
    print(f"| device | layers | DynamicCache peak | RopeKVCache peak | DynamicCache bytes | RopeKVCache bytes | bound |")
    print(f"|---|---|---|---|---|---|---|")
    for device, count in split.items():
        bound = count * capacity * per_slot
        dyn, rope = runs["DynamicCache"], runs["RopeKVCache"]
        dyn_peak, rope_peak = dyn["peak"].get(device), rope["peak"].get(device)
        rope_bytes = rope["cache_bytes"].get(device, 0)
        print(f"| {device} | {count} | {mib(dyn_peak) if dyn_peak is not None else 'n/a'} | "
              f"{mib(rope_peak) if rope_peak is not None else 'n/a'} | {mib(dyn['cache_bytes'].get(device, 0))} | "
              f"{mib(rope_bytes)} | {mib(bound)} |")
        if rope_bytes > bound:
            failures.append(f"{device}: RopeKVCache holds {rope_bytes} bytes, above the bound {bound}")
        if dyn_peak is not None and rope_peak is not None and not rope_peak < dyn_peak:
            failures.append(f"{device}: RopeKVCache peak {mib(rope_peak)} is not below DynamicCache's {mib(dyn_peak)}")
    rope = runs["RopeKVCache"]
    print(f"\nRopeKVCache kept {rope['kept']} of {rope['tokens_seen']} tokens per row ({rope['compactions']} compactions); "
          f"throughput {rope['tokens_per_s']:.0f} tok/s vs DynamicCache {runs['DynamicCache']['tokens_per_s']:.0f} tok/s "
          f"(batch {args.batch}).")
    print(f"total {time.perf_counter() - t_start:.0f} s")

    results["failures"] = failures
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures))
        return 1
    print("\nall checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
