"""Nothing evicted: ``RopeKVCache`` generates ``DynamicCache``'s greedy tokens and logits, at a Qwen3 shape.

Formerly ``benchmarks/exactness_check.py``. The CPU variant runs a tiny Qwen3 in float32 on a left-padded batch;
the CUDA variant (``gpu``) the Qwen3-1.7B shape in bf16 and fp16 with cuDNN's sdpa off: on an H200 that backend
did not give the same logits twice, even for DynamicCache against itself
(benchmarks/results/exactness_2026-11-30_6ba6bcb), while flash / efficient attention were bit-identical in all
12 comparisons. Every run is compared with an independent ``DynamicCache`` run of the same dtype.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, Qwen3Config

from hf_ropekv import RopeKVCache
from hf_ropekv._compat import cache_kwarg

TINY_QWEN3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, vocab_size=512)
QWEN3_1_7B = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936)


def random_qwen3(shape: dict[str, int], dtype: torch.dtype, device: str) -> torch.nn.Module:
    """A random-weight Qwen3 of ``shape``, initialised on ``device`` (seconds on a GPU for 1.7B)."""
    config = Qwen3Config(**shape, max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, pad_token_id=0, bos_token_id=None, eos_token_id=None,
                         use_sliding_window=False)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()


def left_padded(batch: int, longest: int, vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts, row ``i`` shorter by ``i * longest / (2 * batch)`` tokens, left-padded with 0."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (batch, longest), generator=g)
    mask = torch.ones_like(ids)
    for row in range(batch):
        pad = row * longest // (2 * batch)
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    return ids.to(device), mask.to(device)


def greedy(model, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, cache: Any) -> dict[str, torch.Tensor]:
    """Greedy ``generate`` of exactly ``new_tokens``: the sequences and every step's logits, on the CPU."""
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True, output_logits=True, **{cache_kwarg(model): cache})
    return dict(sequences=out.sequences.cpu(), logits=torch.stack([x.float().cpu() for x in out.logits], 1))


def compare(reference: dict, run: dict) -> dict[str, Any]:
    """Identical greedy tokens? If not: the first step where they part and the reference's top-2 margin there.

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
    return dict(identical=False, first_step=step, row=row, top2_margin=margin, max_logit_diff=diff,
                summary=f"DIFFERENT from step {step} (row {row}: reference top-2 margin {margin:.3g}, "
                        f"max |dlogit| up to there {diff:.3g})")


def check_nothing_evicted(shape: dict[str, int], dtype: torch.dtype, device: str, batch: int, prompt: int,
                          new_tokens: int) -> None:
    model = random_qwen3(shape, dtype, device)
    ids, mask = left_padded(batch, prompt, shape["vocab_size"], device)
    reference = greedy(model, ids, mask, new_tokens, DynamicCache(config=model.config))
    big_budget = 2 * (prompt + new_tokens)
    variants = {
        "DynamicCache (again)": lambda: DynamicCache(config=model.config),
        "RopeKVCache(budget=None)": lambda: RopeKVCache(model, budget=None),
        f"RopeKVCache(budget={big_budget})": lambda: RopeKVCache(model, budget=big_budget),
    }
    verdicts = {}
    for label, make in variants.items():
        cache = make()
        verdicts[label] = compare(reference, greedy(model, ids, mask, new_tokens, cache))
        if isinstance(cache, RopeKVCache):
            assert cache.num_compactions == 0, f"{label} evicted: the check needs nothing evicted"
    assert all(v["identical"] and v["max_logit_diff"] == 0.0 for v in verdicts.values()), {
        k: v["summary"] for k, v in verdicts.items()}


def test_nothing_evicted_matches_dynamic_cache_on_cpu() -> None:
    check_nothing_evicted(TINY_QWEN3, torch.float32, "cpu", batch=3, prompt=24, new_tokens=8)


def test_compare_finds_the_first_divergence_and_its_margin() -> None:
    """The comparison itself can fail: a changed token at step 2 of row 1 is found, with the reference's margin."""
    logits = torch.tensor([[[0.0, 1.0, 3.0]] * 4, [[2.0, 0.5, 0.0]] * 4])  # [rows, steps, vocab]
    reference = dict(sequences=torch.tensor([[7, 2, 2, 2, 2], [7, 0, 0, 0, 0]]), logits=logits)
    run = dict(sequences=torch.tensor([[7, 2, 2, 2, 2], [7, 0, 0, 1, 1]]), logits=logits + 0.25)
    verdict = compare(reference, run)
    assert not verdict["identical"] and (verdict["first_step"], verdict["row"]) == (2, 1)
    assert verdict["top2_margin"] == pytest.approx(1.5) and verdict["max_logit_diff"] == pytest.approx(0.25)
    assert compare(reference, reference)["identical"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_nothing_evicted_matches_dynamic_cache_on_cuda_at_qwen3_1_7b(dtype, deterministic_sdpa) -> None:
    check_nothing_evicted(QWEN3_1_7B, dtype, "cuda", batch=8, prompt=256, new_tokens=64)
