"""``examples/generate_long.py``: its summary states the bound and what was kept, and its arguments reach the cache
(a tiny model stands in for SmolLM2)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import generate_long  # examples/, on sys.path through conftest
from hf_ropekv import RopeKVCache
from hf_ropekv._compat import cache_kwarg

BUDGET, COMPRESS_EVERY = 24, 16
PROMPT, NEW = 10, 70


def test_summary_states_the_bound_and_what_was_kept() -> None:
    """The example's end-of-run summary reads the cache's public numbers: kept and seen tokens, the bound, bytes."""
    model = tiny_model("llama")
    cache = RopeKVCache(model, budget=BUDGET, compress_every=COMPRESS_EVERY)
    ids = torch.randint(3, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                   **{cache_kwarg(model): cache})
    text = "\n".join(generate_long.summary_lines(cache, PROMPT, NEW))
    assert cache.num_compactions >= 2
    assert f"kept {cache.tokens_kept:,} of {cache.tokens_seen:,} tokens" in text
    assert f"budget {BUDGET} + compress_every {COMPRESS_EVERY} = {BUDGET + COMPRESS_EVERY}" in text
    assert "growing cache, eager" in text and "nothing was evicted" not in text


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
    assert cache.options.protect_prompt is False and cache.num_compactions >= 1
    assert cache.tokens_kept <= 16 + 8 < 40  # the 40-token prompt did not stay pinned
    assert "compactions" in capsys.readouterr().out
