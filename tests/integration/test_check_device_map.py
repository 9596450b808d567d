"""RopeKVCache on a model split by ``from_pretrained(..., device_map=...)``: exact with nothing evicted, bounded per
device with eviction.

Formerly ``benchmarks/device_map_check.py``. A random Qwen3 is saved and reloaded on one device and split over
two (``multi_gpu``: Qwen3-1.7B's shape, ``device_map="auto"`` over cuda:0 and cuda:1; the CPU variant: a tiny
shape, every module mapped to "cpu" explicitly, so accelerate's hooks run as on a split model).

1. Nothing evicted: ``RopeKVCache(budget=None)`` on one device and ``DynamicCache``, ``RopeKVCache(budget=None)``
   and ``enable(model, budget=None)`` on the split model give one-device ``DynamicCache``'s tokens and logits
   exactly in float32. In bf16 (GPUs only) a divergence is allowed at a near-tie of the reference's logits:
   random weights give exact bf16 ties, which flipped even between two DynamicCache runs (split and one GPU) on
   2xH200 (benchmarks/results/device_map_2x_h200).
2. Bounded memory: in a long generation every layer's pages sit on its layer's device, the bytes RopeKVCache holds
   on each device stay within its layers' bound, and (GPUs) its peak stays below DynamicCache's.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from hf_ropekv import RopeKVCache
from hf_ropekv._compat import cache_kwarg
from hf_ropekv import disable, enable
from test_check_exactness import QWEN3_1_7B, TINY_QWEN3, compare, greedy, left_padded, random_qwen3

BF16_NEAR_TIE = 0.25


def layer_devices(model) -> list[torch.device]:
    """The device each decoder layer computes on (its execution device under accelerate)."""
    devices = []
    for layer in model.model.layers:
        execution = getattr(getattr(layer, "_hf_hook", None), "execution_device", None)
        if execution is None:
            execution = next(layer.parameters()).device
        devices.append(torch.device(execution))
    return devices


def misplaced_layers(cache: RopeKVCache, per_layer: list[torch.device]) -> list[int]:
    """Indices of layers whose slots are not on the device their decoder layer computes on. (Read under
    inference mode, as the cache was filled: see test_a_cache_filled_under_inference_mode_continues_outside_it.)"""
    with torch.inference_mode():
        return [i for i in range(len(cache.layers)) if cache.kept_positions(i).device != per_layer[i]]


def bytes_by_device(cache: RopeKVCache) -> dict[torch.device, int]:
    """Bytes each device holds for the cache (private: ``bytes_held`` is the total; a split model's bound is per
    device, read from each layer's storage)."""
    out: dict[torch.device, int] = {}
    for layer in cache.layers:
        storage = getattr(layer, "storage", None)
        if storage is not None and storage.keys is not None:
            out[storage.keys.device] = out.get(storage.keys.device, 0) + storage.bytes_held
    return out


def peak_growth(devices: list[torch.device], run) -> tuple[Any, dict[torch.device, int]]:
    """``run()``'s result and, per CUDA device, its peak allocated memory above what was allocated before."""
    gc.collect()
    base = {}
    for d in devices:
        torch.cuda.synchronize(d)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(d)
        base[d] = torch.cuda.memory_allocated(d)
    result = run()
    peaks = {}
    for d in devices:
        torch.cuda.synchronize(d)
        peaks[d] = torch.cuda.max_memory_allocated(d) - base[d]
    return result, peaks


def check_split_model(workdir: Path, shape: dict[str, int], devices: list[str], dtypes: list[torch.dtype],
                      sizes: dict[str, int]) -> None:
    random_qwen3(shape, dtypes[-1], devices[0]).save_pretrained(workdir / "model")
    gc.collect()
    on_gpus = devices[0].startswith("cuda")
    if on_gpus:
        device_map: Any = "auto"
    else:
        device_map = {name: "cpu" for name in ("model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head")}
        device_map.update({f"model.layers.{i}": "cpu" for i in range(shape["num_hidden_layers"])})

    def load(where: Any, dtype: torch.dtype):
        # The one-device reference loads by the same path as the split model: RoPE's inv_freq computed elsewhere
        # differs by an ulp, which flips near-tied tokens of random weights.
        return AutoModelForCausalLM.from_pretrained(workdir / "model", device_map=where, dtype=dtype,
                                                    attn_implementation="sdpa").eval()

    batch, prompt, new = sizes["batch"], sizes["prompt"], sizes["exact_new_tokens"]
    for dtype in dtypes:
        single = load({"": devices[0]}, dtype)
        ids, mask = left_padded(batch, prompt, shape["vocab_size"], devices[0])
        reference = greedy(single, ids, mask, new, DynamicCache(config=single.config))
        runs = {"one device, RopeKVCache(budget=None)": greedy(single, ids, mask, new, RopeKVCache(single, None))}
        del single
        model = load(device_map, dtype)
        per_layer = layer_devices(model)
        if on_gpus:
            assert len(set(per_layer)) == 2, f"device_map='auto' did not split the layers: {per_layer}"
        runs["split, DynamicCache"] = greedy(model, ids, mask, new, DynamicCache(config=model.config))
        rope = RopeKVCache(model, budget=None)
        runs["split, RopeKVCache(budget=None)"] = greedy(model, ids, mask, new, rope)
        assert not misplaced_layers(rope, per_layer)
        enable(model, budget=None)
        try:
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                     do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                                     output_logits=True)
            runs["split, enable(budget=None)"] = dict(
                sequences=out.sequences.cpu(), logits=torch.stack([x.float().cpu() for x in out.logits], 1))
        finally:
            disable(model)
        for name, run in runs.items():
            verdict = compare(reference, run)
            if dtype == torch.float32:
                assert verdict["identical"] and verdict["max_logit_diff"] == 0.0, f"{name}: {verdict['summary']}"
            else:
                assert verdict["identical"] or verdict["top2_margin"] <= BF16_NEAR_TIE, f"{name}: {verdict['summary']}"

    # Long generation with eviction, on the last dtype's split model.
    budget, ce = sizes["budget"], sizes["compress_every"]
    used = list(dict.fromkeys(per_layer))
    caches = {"DynamicCache": DynamicCache(config=model.config),
              "RopeKVCache": RopeKVCache(model, budget=budget, compress_every=ce)}
    peaks = {}
    for name, cache in caches.items():
        def run(cache=cache):
            with torch.inference_mode():
                return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=sizes["new_tokens"],
                                      min_new_tokens=sizes["new_tokens"], do_sample=False, pad_token_id=0,
                                      **{cache_kwarg(model): cache})
        if on_gpus:
            _, peaks[name] = peak_growth(used, run)
        else:
            run()
    rope = caches["RopeKVCache"]
    assert rope.num_compactions >= 1 and rope.tokens_kept <= budget + ce
    assert not misplaced_layers(rope, per_layer)
    # The bound: every layer holds at most budget + compress_every slots (pages stop at the bound); 8 bytes of
    # position bookkeeping per slot come on top of keys and values.
    capacity = budget + ce
    element = torch.empty((), dtype=dtypes[-1]).element_size()
    per_slot = batch * shape["num_key_value_heads"] * (2 * shape["head_dim"] * element + 8)
    held = bytes_by_device(rope)
    for device in used:
        layers = sum(1 for d in per_layer if d == device)
        assert 0 < held[device] <= layers * capacity * per_slot, (device, held[device])
        if on_gpus:
            assert peaks["RopeKVCache"][device] < peaks["DynamicCache"][device], (device, peaks)


def test_split_model_on_cpu_is_exact_and_bounded(tmp_path: Path) -> None:
    check_split_model(tmp_path, {**TINY_QWEN3, "num_hidden_layers": 4}, ["cpu", "cpu"], [torch.float32],
                      dict(batch=3, prompt=12, exact_new_tokens=16, new_tokens=48, budget=24, compress_every=8))


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_split_model_on_two_gpus_is_exact_and_bounded(tmp_path: Path) -> None:
    check_split_model(tmp_path, QWEN3_1_7B, ["cuda:0", "cuda:1"], [torch.float32, torch.bfloat16],
                      dict(batch=8, prompt=256, exact_new_tokens=64, new_tokens=1536, budget=512,
                           compress_every=128))
