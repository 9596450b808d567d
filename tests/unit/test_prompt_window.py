"""The default scorer's prompt window holds each layer's last queries after RoPE, as the model's attention saw them.

The reference is the model's own rotary embedding and ``apply_rotary_pos_emb`` at each row's positions (left padding
shifts them), independent of hf_ropekv's ``rotate``.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from conftest import tiny_model

from hf_ropekv.model.geometry import describe
from hf_ropekv.scorers.prompt_window import PromptWindow


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_every_layer_window_equals_the_models_rope(arch: str) -> None:
    model = tiny_model(arch, num_hidden_layers=3)
    geometry = describe(model)
    heads, dim = model.config.num_attention_heads, geometry.head_dim
    batch, seen, new, window = 2, 5, 11, 4
    pads = torch.tensor([0, 3])
    mask = torch.arange(new)[None, :] >= (pads - seen).clamp_min(0)[:, None]  # padding lies in the earlier tokens
    prompt_window = PromptWindow(geometry, window)
    prompt_window.begin_forward(seen, new, pads, mask)
    # Fresh random queries per layer; layer 2 in bf16, so the window rotates two groups of layers.
    queries = {i: torch.randn(batch, new, heads, dim) * (1 + i) for i in range(3)}
    queries[2] = queries[2].to(torch.bfloat16)
    for i, q in queries.items():
        prompt_window.add(i, q)
    prompt_window.end_forward()

    modeling = importlib.import_module(type(model).__module__)
    positions = torch.arange(seen + new - window, seen + new)[None, :] - pads[:, None]  # RoPE positions [B, w]
    for i, q in queries.items():
        got, index, count = prompt_window.take(i)
        assert count == window and got.dtype == q.dtype and got.shape == (batch, heads, window, dim)
        assert torch.equal(index, torch.arange(seen + new - window, seen + new).expand(batch, -1))
        tail = q[:, -window:].transpose(1, 2).float()  # [B, H, w, D]
        cos, sin = model.model.rotary_emb(tail, positions)
        want, _ = modeling.apply_rotary_pos_emb(tail, tail, cos, sin)
        tol = 1e-5 if q.dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want, atol=tol * q.abs().max().item(), rtol=0)


def test_a_decoding_step_makes_the_window_stale_and_copies_keep_no_prompt_alive() -> None:
    model = tiny_model("llama", num_hidden_layers=2)
    geometry = describe(model)
    prompt_window = PromptWindow(geometry, 3)
    prompt_window.begin_forward(0, 8, torch.zeros(1, dtype=torch.long), None)
    q = torch.randn(1, 8, model.config.num_attention_heads, geometry.head_dim)
    prompt_window.add(0, q)
    assert prompt_window._pending[0].untyped_storage().nbytes() < q.untyped_storage().nbytes()  # a copy, not a view
    prompt_window.end_forward()
    assert prompt_window.take(0)[2] == 3 and prompt_window.take(1) == (None, None, 0)
    prompt_window.begin_forward(8, 1, torch.zeros(1, dtype=torch.long), None)
    prompt_window.add(0, q[:, :1])
    prompt_window.end_forward()
    assert prompt_window.take(0) == (None, None, 0)
