"""RopeKVCache on models dispatched by accelerate (the CPU stand-ins for a multi-GPU ``device_map``).

A machine without GPUs cannot split layers over two devices, but the code paths a ``device_map`` brings are
the same: accelerate's ``AlignDevicesHook`` wraps every dispatched module's forward, moves its inputs
(``send_to_device``, which must leave the cache object alone) and loads offloaded weights just in time.
Checked here:

- ``from_pretrained(..., device_map={...})`` with some layers offloaded to disk and ``accelerate.cpu_offload``;
- tokens identical to ``DynamicCache`` with ``budget=None``, and identical to the undispatched model with eviction;
- ``hf_ropekv.enable`` on a dispatched model.

The two-GPU run (``tests/test_check_device_map.py``) checks identical tokens against one GPU and the memory of
each GPU.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from conftest import cache_kw, padded_batch, tiny_model
from hf_ropekv import RopeKVCache
from hf_ropekv import disable, enable

accelerate = pytest.importorskip("accelerate")

EVICTING = dict(budget=16, compress_every=4)


def gen(model, cache, ids, mask, **kwargs) -> torch.Tensor:
    extra = cache_kw(model, cache) if cache is not None else {}
    return model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0, **extra, **kwargs
    )


def disk_offloaded(tmp_path, arch: str):
    """The tiny model saved and reloaded with a per-module device_map: layer 1 offloaded to disk."""
    source = tiny_model(arch)
    source.save_pretrained(tmp_path / "model")
    names = [name for name, _ in source.named_children()]  # ("model", "lm_head")
    inner = dict(source.model.named_children())
    device_map = {f"model.{name}": "cpu" for name in inner if name != "layers"}
    device_map.update({f"model.layers.{i}": "cpu" for i in range(len(source.model.layers))})
    device_map[f"model.layers.{len(source.model.layers) - 1}"] = "disk"
    device_map.update({name: "cpu" for name in names if name != "model"})
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "model",
        device_map=device_map,
        offload_folder=str(tmp_path / "offload"),
        dtype=torch.float32,
        attn_implementation="sdpa",
    ).eval()
    return source, model


def test_disk_offloaded_device_map(tmp_path) -> None:
    source, model = disk_offloaded(tmp_path, "llama")
    assert getattr(model, "hf_device_map", None), "the model was dispatched"
    layer = model.model.layers[-1]
    assert hasattr(layer, "_hf_hook"), "the offloaded layer runs under an accelerate hook"
    assert layer.self_attn.k_proj.weight.device.type == "meta", "its weights live on disk until it runs"

    ids, mask = padded_batch()
    full = gen(model, DynamicCache(config=model.config), ids, mask)
    assert torch.equal(gen(model, RopeKVCache(model, budget=None), ids, mask), full)
    assert torch.equal(gen(source, DynamicCache(config=source.config), ids, mask), full)

    cache = RopeKVCache(model, **EVICTING)
    evicted = gen(model, cache, ids, mask)
    assert cache.num_compactions > 0 and cache.tokens_kept <= EVICTING["budget"] + EVICTING["compress_every"]
    assert torch.equal(evicted, gen(source, RopeKVCache(source, **EVICTING), ids, mask))


@pytest.mark.filterwarnings("ignore:You are calling .generate:UserWarning")  # 5.17: the offloaded model reports "meta"
def test_cpu_offload_hooks_and_enable() -> None:
    from accelerate import cpu_offload

    source = tiny_model("qwen3")
    model = tiny_model("qwen3")
    cpu_offload(model, execution_device=torch.device("cpu"))
    assert hasattr(model, "_hf_hook")

    ids, mask = padded_batch(lengths=(9, 9))
    assert torch.equal(
        gen(model, RopeKVCache(model, budget=None), ids, mask),
        gen(source, DynamicCache(config=source.config), ids, mask)
    )
    want = gen(source, RopeKVCache(source, **EVICTING), ids, mask)
    enable(model, **EVICTING)
    try:
        first = gen(model, None, ids, mask)
        second = gen(model, None, ids, mask)
    finally:
        disable(model)
    assert torch.equal(first, want) and torch.equal(second, want)


def test_pages_follow_their_layers_device(tmp_path) -> None:
    """Each layer's pages are allocated where that layer's keys are computed (its execution device)."""
    source, model = disk_offloaded(tmp_path, "llama")
    ids, mask = padded_batch(lengths=(6,))
    cache = RopeKVCache(model, **EVICTING)
    gen(model, cache, ids, mask)
    for idx in range(len(cache.layers)):
        execution = model.model.layers[idx].self_attn.k_proj.weight.device
        if execution.type == "meta":  # offloaded: computed on the hook's execution device
            execution = model.model.layers[idx]._hf_hook.execution_device
            execution = torch.device(execution) if not isinstance(execution, torch.device) else execution
        assert cache.kept_positions(idx).device.type == execution.type  # read where the layer's slots live
