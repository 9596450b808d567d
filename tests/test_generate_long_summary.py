"""The summary ``examples/generate_long.py`` prints: the bound on kept tokens and the bytes held, part by part.

A tiny model stands in for SmolLM2; the parts are checked against the arena's formula and against the bytes
a ``DynamicCache`` actually holds for the same generation.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import tiny_model
from transformers import DynamicCache

import generate_long  # examples/, on sys.path through conftest
from hf_ropekv import RopeKVCache
from hf_ropekv._compat import cache_kwarg

BUDGET, COMPRESS_EVERY, PAGE = 24, 16, 16
PROMPT, NEW = 10, 70


def _generate(model, cache) -> None:
    ids = torch.randint(3, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                   **{cache_kwarg(model): cache})


def _dynamic_bytes(model) -> tuple[int, int]:
    """Bytes a ``DynamicCache`` holds after the same generation: (full-attention layers, sliding layers)."""
    cache = DynamicCache(config=model.config)
    _generate(model, cache)
    full = sliding = 0
    for layer in cache.layers:
        n = layer.keys.nbytes + layer.values.nbytes
        if getattr(layer, "is_sliding", False):
            sliding += n
        else:
            full += n
    return full, sliding


@pytest.fixture(scope="module")
def llama_run():
    model = tiny_model("llama")
    cache = RopeKVCache(model, budget=BUDGET, compress_every=COMPRESS_EVERY, page_size=PAGE)
    _generate(model, cache)
    return model, cache


def test_parts_follow_the_arena_formula(llama_run) -> None:
    model, cache = llama_run
    cfg = model.config
    layers, heads, head_dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    kept, seen = cache.tokens_kept, cache.tokens_seen
    assert cache.num_compactions >= 2 and BUDGET <= kept <= BUDGET + COMPRESS_EVERY
    slot_kv = 2 * head_dim * 4  # float32 key + value, one KV head
    capacity = BUDGET + COMPRESS_EVERY  # 40: the steady-state bound (its last page cut to it)

    parts = generate_long.kv_bytes(cache)
    assert parts.kept_kv == layers * heads * kept * slot_kv
    assert parts.spare_kv == layers * heads * (capacity - kept) * slot_kv
    assert parts.positions == layers * heads * capacity * 8
    assert parts.sliding == 0
    assert parts.held == cache.bytes_held
    assert parts.full == _dynamic_bytes(model)[0] == layers * heads * seen * slot_kv
    assert parts.kept_kv / parts.full == pytest.approx(kept / seen)  # no sliding layers: the token ratio


def test_summary_text_states_the_bound_and_adds_up(llama_run) -> None:
    _, cache = llama_run
    text = "\n".join(generate_long.summary_lines(cache, PROMPT, NEW))
    kept, seen = cache.tokens_kept, cache.tokens_seen
    assert f"tokens kept / seen   {kept} / {seen}  ({kept / seen:.1%}" in text
    assert f"budget + compress-every = {BUDGET} + {COMPRESS_EVERY} = {BUDGET + COMPRESS_EVERY}" in text
    assert f"compactions          {cache.num_compactions}" in text
    assert "the arena holds 40 slots (3 pages of 16): the bound, budget + compress_every" in text
    assert "beside 128 bytes of K/V" in text

    total = float(re.search(r"\(([\d.]+)% of full\)", text).group(1))
    assert total == round(100 * cache.bytes_held / cache.full_cache_bytes, 1)
    shares = {name: float(p) for name, p in re.findall(r"^  (\S.*?)\s+[\d.]+ MiB\s+([\d.]+)%", text, re.M)}
    assert set(shares) == {"K/V of kept tokens", "free arena slots", "slot positions"}
    assert shares["K/V of kept tokens"] == round(100 * kept / seen, 1)
    assert sum(shares.values()) == pytest.approx(total, abs=0.15)  # each share rounded to 0.1


def test_sliding_layers_are_their_own_part() -> None:
    model = tiny_model("gemma3_text")
    cache = RopeKVCache(model, budget=BUDGET, compress_every=COMPRESS_EVERY, page_size=PAGE)
    _generate(model, cache)
    parts = generate_long.kv_bytes(cache)
    full_layers, sliding_layers = _dynamic_bytes(model)
    assert parts.sliding == sliding_layers > 0
    assert parts.held == cache.bytes_held
    assert parts.full == full_layers + sliding_layers
    text = "\n".join(generate_long.summary_lines(cache, PROMPT, NEW))
    assert re.search(r"^  sliding layers +[\d.]+ MiB +[\d.]+%", text, re.M)


# --------------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--budget", "0"], "--budget must be a positive"),
        (["--budget", "-5"], "--budget must be a positive"),
        (["--compress-every", "0"], "--compress-every must be >= 1"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--max-new-tokens", "10", "--min-new-tokens", "11"], "--min-new-tokens must lie in"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--prompt", "  "], "--prompt is empty"),
    ],
)
def test_bad_arguments_fail_before_the_model_loads(monkeypatch, capsys, argv, message) -> None:
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(generate_long, "load_smollm2", no_load)
    with pytest.raises(SystemExit) as exit_info:
        generate_long.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_protect_prompt_is_on_by_default_and_can_be_turned_off() -> None:
    assert generate_long.parse_args([]).protect_prompt is True
    args = generate_long.parse_args(["--no-protect-prompt", "--budget", "64"])
    assert args.protect_prompt is False and args.budget == 64


def test_no_protect_prompt_reaches_the_cache(monkeypatch, capsys) -> None:
    """The flag is passed to RopeKVCache: with the prompt unpinned, a prompt longer than the budget is evicted."""
    model = tiny_model("llama")

    class Tokenizer:
        pad_token_id = 0
        eos_token_id = None

        def apply_chat_template(self, messages, **kwargs):
            ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

        def decode(self, ids, **kwargs):
            return ""

    made: list[RopeKVCache] = []

    class Recording(RopeKVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(generate_long, "load_smollm2", lambda **kwargs: (model, Tokenizer()))
    monkeypatch.setattr(generate_long, "RopeKVCache", Recording)
    generate_long.main(["--budget", "16", "--compress-every", "8", "--max-new-tokens", "20", "--min-new-tokens",
                        "20", "--no-protect-prompt", "--no-stream", "--greedy", "--device", "cpu"])
    (cache,) = made
    assert cache.protect_prompt is False and cache.num_compactions >= 1
    assert cache.tokens_kept <= 16 + 8 < 40  # the 40-token prompt did not stay pinned
    assert "compactions" in capsys.readouterr().out
