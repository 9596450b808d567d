"""Suite part e: the fp16 path (what a T4 runs) at the Qwen3-1.7B shape.

The Triton kernels against their PyTorch twins on fp16 keys (CUDA only), greedy ``generate()`` with nothing
evicted against DynamicCache, ``generate()`` with eviction, and decode speed at batch 4, 4K tokens.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

import models
from common import Memory, Progress
from suite_harness import DYNAMIC, ROPE, Bench, Settings, decode_point

from hf_ropekv import RopeKVCache  # after suite_harness, which imports hf_ropekv from the checkout


def part_e(s: Settings, device: torch.device, log: Progress, mem: Memory, out: dict) -> None:
    config = models.make_config(s.shape_e)
    out["shape"] = dict(name=s.shape_e, dtype="float16", **models.shape_summary(config))
    log(f"[e] building {s.shape_e} in float16")
    model = models.build_random_model(config, dtype=torch.float16, device=device)
    try:
        bench = Bench(model, s, device, log, mem)
        # ---- kernels against their PyTorch twins, fp16 keys in a strided arena view
        if device.type == "cuda":
            from hf_ropekv.kernels import compact as kc
            from hf_ropekv.kernels import score as ks
            from hf_ropekv.scorers.rope_scoring import query_weights

            stats = models.random_frequency_stats(model)
            q_mean, q_abs = stats.for_layer(0)
            inv_freq = torch.tensor(stats.metadata["inv_freq"], dtype=torch.float32)
            w, c = query_weights(q_mean.to(device), q_abs.to(device), inv_freq.to(device), 40000)
            arena = torch.randn(2, config.num_key_value_heads, 1536, config.head_dim, device=device, dtype=torch.float16)
            keys = arena[:, :, :1400]
            got = ks.score_keys_triton(keys, w, c)
            want = ks.score_keys_reference(keys, w, c)
            rel = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
            keep = torch.sort(torch.rand(2, config.num_key_value_heads, 1400, device=device).topk(900, dim=-1).indices)[0]
            a1, a2 = arena.clone(), arena.clone()
            kc.compact_triton_([a1], keep)
            kc.compact_reference_([a2], keep)
            out["kernels"] = dict(
                score_max_rel_err=rel, compact_exact=bool(torch.equal(a1, a2)), dtype="float16", backend="triton"
            )
            log(f"[e] fp16 kernels: score max rel err {rel:.2e}, compaction exact: {torch.equal(a1, a2)}")
        else:
            out["kernels"] = dict(backend="torch reference (no CUDA)")
        # ---- exactness through generate(): nothing evicted -> identical greedy tokens
        ids = bench.random_ids(2, 32)
        kwargs = dict(
            attention_mask=torch.ones_like(ids),
            pad_token_id=0,
            max_new_tokens=24,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
        )
        ref = model.generate(input_ids=ids, **{bench.kwarg: DynamicCache(config=config)}, **kwargs)
        got = model.generate(input_ids=ids, **{bench.kwarg: RopeKVCache(model, budget=None)}, **kwargs)
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(ref.logits, got.logits))
        out["exact"] = dict(
            identical_tokens=bool(torch.equal(ref.sequences, got.sequences)),
            max_logit_diff=diff,
            finite_logits=all(bool(torch.isfinite(x).all()) for x in ref.logits),
        )
        log(f"[e] budget=None vs DynamicCache: identical tokens {out['exact']['identical_tokens']}, max |dlogit| {diff:.2e}")
        # ---- eviction through generate()
        cache = RopeKVCache(
            model, budget=s.e_gen_budget, compress_every=s.e_gen_compress_every, **bench.scorer_kwargs()
        )
        prompt = bench.random_ids(2, 8)
        seq = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            pad_token_id=0,
            max_new_tokens=s.e_gen_tokens,
            do_sample=False,
            **{bench.kwarg: cache},
        )
        out["eviction"] = dict(
            budget=s.e_gen_budget,
            compress_every=s.e_gen_compress_every,
            new_tokens=int(seq.shape[1] - 8),
            seen=bench.seen(cache),
            kept=bench.kept(cache),
            compactions=bench.compactions(cache),
            kept_within_bound=bench.kept(cache) <= s.e_gen_budget + s.e_gen_compress_every,
        )
        log(f"[e] generate() with eviction: {out['eviction']}")
        cache = None
        # ---- decode speed, fp16
        rows = []
        for kind, budget in ((DYNAMIC, None), (ROPE, s.e_budget)):
            rows.append(decode_point(bench, kind, budget, s.e_batch, s.e_context))
            log(f"[e] {rows[-1]['cache']} batch {s.e_batch} T={s.e_context}: {rows[-1]['tokens_per_s']:.1f} tok/s")
        out["decode"] = rows
    finally:
        model = None
        mem.clean()
