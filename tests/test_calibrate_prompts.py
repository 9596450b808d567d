"""hf_ropekv.calibrate(model, tokenizer, prompts=[...]): statistics of the prompts with the model's own answers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import hf_ropekv
from conftest import tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import CharTokenizer  # noqa: E402  one token per character, a chat template of its own

PROMPTS = ["tom has 3 apples and buys 4 how many", "what is 12 plus 30"]


class TemplatedCharTokenizer(CharTokenizer):
    chat_template = "<role>content"  # only its presence matters: apply_chat_template renders the messages


def _answered(model, prompt_ids: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                         pad_token_id=0)
    return out[0].tolist()


@pytest.mark.parametrize("templated", [False, True])
def test_prompts_are_answered_greedily_and_calibrated_with_their_answers(templated: bool) -> None:
    model = tiny_model("llama")
    tokenizer = TemplatedCharTokenizer() if templated else CharTokenizer()
    stats = hf_ropekv.calibrate(model, tokenizer, prompts=PROMPTS, max_new_tokens=9, progress=False)
    if templated:
        prompt_ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                    return_dict=True)["input_ids"] for p in PROMPTS]
    else:
        prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    sequences = [_answered(model, ids, 9) for ids in prompt_ids]  # independent: plain generate, DynamicCache
    expected = hf_ropekv.calibrate(model, None, sequences, progress=False)
    assert stats.tokens == expected.tokens == sum(len(ids) + 9 for ids in prompt_ids)
    torch.testing.assert_close(stats.q_mean, expected.q_mean, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(stats.q_abs_mean, expected.q_abs_mean, atol=1e-6, rtol=1e-5)
    # The answers count: statistics of the prompts alone differ.
    prompts_only = hf_ropekv.calibrate(model, None, prompt_ids, progress=False)
    assert not torch.allclose(stats.q_abs_mean, prompts_only.q_abs_mean, atol=1e-4)
    assert "prompt(s) with the model's greedy answers" in stats.metadata["source"]


def test_a_batch_calibrates_each_answer_up_to_its_end_of_sequence_only() -> None:
    # generate() feeds a finished row pad filler until the batch's longest answer ends; none of it may be
    # calibrated on. Make prompt 1's answer end early by declaring one of its tokens the end of sequence.
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    tokenizer = CharTokenizer()
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    answers = [_answered(model, ids, 9)[len(ids):] for ids in prompt_ids]
    cut = next(i for i in range(1, 8) if answers[1][i] not in answers[1][:i] and answers[1][i] not in answers[0])
    model.generation_config.eos_token_id = answers[1][cut]
    expected = hf_ropekv.calibrate(model, None, [prompt_ids[0] + answers[0], prompt_ids[1] + answers[1][: cut + 1]],
                                   progress=False)
    end_of_turn = type("EndOfTurnTokenizer", (CharTokenizer,), {"eos_token_id": answers[1][cut]})()
    for batch_size, by_tokenizer in ((2, False), (1, False), (2, True)):  # together (row 1 ends first, then gets
        # filler) and one by one; the end marked by the model's generation config, or only by the tokenizer
        model.generation_config.eos_token_id = None if by_tokenizer else answers[1][cut]
        stats = hf_ropekv.calibrate(model, end_of_turn if by_tokenizer else tokenizer, prompts=PROMPTS,
                                    max_new_tokens=9, batch_size=batch_size, progress=False)
        assert stats.tokens == expected.tokens == sum(map(len, prompt_ids)) + 9 + cut + 1
        torch.testing.assert_close(stats.q_mean, expected.q_mean, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(stats.q_abs_mean, expected.q_abs_mean, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        hf_ropekv.calibrate(model, tokenizer, prompts=PROMPTS, batch_size=0, progress=False)


def test_texts_stay_positional_and_exactly_one_source_is_required() -> None:
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    assert hf_ropekv.calibrate(model, None, ids, 32768, 4096, None, False).tokens == 20
    with pytest.raises(ValueError, match="either texts"):
        hf_ropekv.calibrate(model, CharTokenizer(), ids, prompts=PROMPTS, progress=False)
    with pytest.raises(ValueError, match="either texts"):
        hf_ropekv.calibrate(model, CharTokenizer(), progress=False)
    with pytest.raises(TypeError, match="prompts must be a non-empty list of strings"):
        hf_ropekv.calibrate(model, CharTokenizer(), prompts="one prompt", progress=False)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        hf_ropekv.calibrate(model, CharTokenizer(), prompts=PROMPTS, max_new_tokens=0, progress=False)


def test_an_enabled_model_answers_with_a_full_cache_and_learns_nothing() -> None:
    model = tiny_model("llama")
    plain = hf_ropekv.calibrate(model, CharTokenizer(), prompts=PROMPTS, max_new_tokens=9, progress=False)
    with hf_ropekv.enabled(model, budget=8, compress_every=2, window=2):
        enabled = hf_ropekv.calibrate(model, CharTokenizer(), prompts=PROMPTS, max_new_tokens=9, progress=False)
    torch.testing.assert_close(enabled.q_mean, plain.q_mean, atol=0, rtol=0)
    assert hf_ropekv.workload_statistics(model).tokens == 0


@pytest.mark.slow
def test_prompts_on_smollm2(smollm2) -> None:
    model, tokenizer = smollm2
    stats = hf_ropekv.calibrate(model, tokenizer, prompts=["What is 7 times 8?"], max_new_tokens=24, progress=False)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 7 times 8?"}],
                                        add_generation_prompt=True, return_dict=True)["input_ids"]
    assert len(ids) < stats.tokens <= len(ids) + 24
    assert stats.metadata.get("weights_fingerprint")
    cache = hf_ropekv.RopeKVCache(model, budget=64, stats=stats)
    assert cache.workload_prior_tokens == 0
