"""RopeKVCache under transformers' tensor parallelism (``tp_plan="auto"``), issue 14 item 3.

    torchrun --nproc_per_node 2 benchmarks/tp_check.py --out /tmp/tp            # CPU, gloo (random tiny Qwen3)
    torchrun --nproc_per_node 2 benchmarks/tp_check.py --device cuda --out ...  # GPUs, nccl

Every rank loads the same random-weight model (built from a config, saved once per rank with one seed) with
``tp_plan="auto"``, so each rank's attention holds num_heads / world query heads and the cache receives the
local KV heads. On a left-padded batch it checks:

1. ``RopeKVCache(model, budget=None)`` gives ``DynamicCache``'s tokens;
2. ``RopeKVCache(model, budget)`` with the default scorer (online statistics from each rank's own heads)
   completes, evicts, stays within ``budget + compress_every`` and gives the same tokens on every rank (the
   selection is per KV head and every rank compacts at the same step, so no communication is needed);
3. the same with statistics of the whole model (calibrated on an unsharded copy, as a file would hold them):
   each rank's scorer slices its own heads.

Rank 0 prints a JSON summary and writes ``tp_check.json`` into ``--out``; any failed check exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

# hf_ropekv from this checkout when it is not installed. Appended, not prepended: the root also holds `kernels/`
# (shipped as hf_ropekv.kernels), which must not shadow HuggingFace's `kernels` package that transformers imports.
sys.path.append(str(Path(__file__).resolve().parent.parent))


def _tiny_config(args: argparse.Namespace):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        max_position_embeddings=4096, use_sliding_window=False, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=60)
    parser.add_argument("--budget", type=int, default=24)
    parser.add_argument("--compress-every", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, DynamicCache

    from hf_ropekv import FrequencyScorer, RopeKVCache, calibrate
    from hf_ropekv._compat import cache_kwarg

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        whole = AutoModelForCausalLM.from_config(_tiny_config(args)).eval()  # same seed: same weights per rank
        whole.save_pretrained(tmp)
        model = AutoModelForCausalLM.from_pretrained(tmp, tp_plan="auto", dtype=torch.float32).eval()
    # Statistics of the whole model, as a file calibrated on one device would hold them.
    calib_text = torch.randint(3, 256, (1, 200), generator=torch.Generator().manual_seed(5))
    whole_stats = calibrate(whole, None, calib_text, progress=False)
    device = next(model.parameters()).device
    seen_q_width: list[int] = []
    model.model.layers[0].self_attn.q_proj.register_forward_hook(
        lambda m, a, out: seen_q_width.append(int(out.shape[-1])) if not seen_q_width else None
    )

    gen = torch.Generator().manual_seed(1)
    lengths = (14, 9, 5)
    ids = torch.randint(3, 256, (len(lengths), max(lengths)), generator=gen)
    mask = torch.ones_like(ids)
    for row, length in enumerate(lengths):
        ids[row, : max(lengths) - length], mask[row, : max(lengths) - length] = 0, 0
    ids, mask = ids.to(device), mask.to(device)
    kw = cache_kwarg(model)

    def generate(cache):
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False,
                                  pad_token_id=0, **{kw: cache})

    results: dict = {"world": world, "device": str(device), "model_heads": [args.heads, args.kv_heads]}
    checks: dict[str, bool] = {}
    reference = generate(DynamicCache(config=model.config))
    exact = generate(RopeKVCache(model, budget=None))
    checks["budget=None equals DynamicCache"] = bool(torch.equal(exact, reference))

    for name, scorer in (("online statistics", None), ("whole-model statistics file", "calibrated")):
        scorer = FrequencyScorer(stats=whole_stats) if scorer == "calibrated" else None
        cache = RopeKVCache(model, budget=args.budget, compress_every=args.compress_every, scorer=scorer)
        start = time.perf_counter()
        out = generate(cache)
        kept = cache.tokens_kept
        gathered = [torch.empty_like(out) for _ in range(world)] if world > 1 else [out]
        if world > 1:
            torch.distributed.all_gather(gathered, out)
        results[name] = {
            "local_kv_heads": int(cache.kept_positions(0).shape[1]),
            "seconds": round(time.perf_counter() - start, 2), "tokens_seen": cache.tokens_seen, "tokens_kept": kept,
            "compactions": cache.num_compactions, "bytes_held": cache.bytes_held,
            "max_memory_allocated": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
        }
        within = kept <= args.budget + args.compress_every
        checks[f"{name}: evicts within budget + compress_every"] = bool(cache.evicted and within)
        checks[f"{name}: same tokens on every rank"] = all(torch.equal(g, out) for g in gathered)
    # For reference (not a check: the sharded forward sums in another order): the unsharded model, same statistics.
    with torch.no_grad():
        unsharded = whole.generate(input_ids=ids.cpu(), attention_mask=mask.cpu(), max_new_tokens=args.new_tokens,
                                   do_sample=False, pad_token_id=0, **{kw: RopeKVCache(
                                       whole, budget=args.budget, compress_every=args.compress_every,
                                       scorer=FrequencyScorer(stats=whole_stats))})
    same = bool(torch.equal(unsharded, out.cpu()))
    results["whole-model statistics file"]["same tokens as the unsharded model"] = same
    results["q_proj_output_width_rank0"] = seen_q_width[0]
    checks["attention sees its share of the heads"] = seen_q_width[0] == args.heads * args.head_dim // world
    results["checks"] = checks
    if rank == 0:
        print(json.dumps(results, indent=2))
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "tp_check.json").write_text(json.dumps(results, indent=2) + "\n")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
