"""One model, two threads: ``generate()`` from two threads at once (a web server's handler threads) gives each
thread exactly the tokens it gets alone. Reference: the same calls run one after the other."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import compiled, tiny_model

import hf_ropekv
from hf_ropekv import RopeKVCache, _compat

pytestmark = pytest.mark.filterwarnings("ignore:hf_ropekv.enable. budget=16 is small")
OPTIONS = dict(budget=16, compress_every=8)  # 12-token prompts, 24 new tokens: several compactions


def _prompts() -> list[torch.Tensor]:
    return [torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(seed)) for seed in (1, 2)]


def _generate(model, prompt: torch.Tensor, cache=None) -> torch.Tensor:
    kwargs = {} if cache is None else {_compat.cache_kwarg(model): cache}
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False,
                          pad_token_id=0, **kwargs)


def _in_two_threads(work) -> list[torch.Tensor]:
    """Run ``work(i)`` for i = 0, 1 in two threads started together; re-raise what a thread raised."""
    results: list = [None, None]
    start = threading.Barrier(2)

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = work(i)
        except BaseException as error:  # handed to the main thread
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_two_threads_generating_on_one_enabled_model_get_their_serial_tokens(arch: str) -> None:
    model = hf_ropekv.enable(tiny_model(arch), **OPTIONS)
    prompts = _prompts()
    serial = [_generate(model, prompt) for prompt in prompts]
    assert hf_ropekv.last_summary(model).num_compactions > 0
    for _ in range(3):
        got = _in_two_threads(lambda i: _generate(model, prompts[i]))
        for mine, want in zip(got, serial):
            assert torch.equal(mine, want)


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
def test_two_threads_with_their_own_caches_get_their_serial_tokens(static: bool) -> None:
    model = tiny_model("llama")
    prompts = _prompts()

    def cache() -> RopeKVCache:
        return RopeKVCache(model, **OPTIONS, static=static)

    serial = [_generate(model, prompt, cache()) for prompt in prompts]
    for _ in range(3):
        got = _in_two_threads(lambda i: _generate(model, prompts[i], cache()))
        for mine, want in zip(got, serial):
            assert torch.equal(mine, want)


def test_a_prepared_static_step_that_never_runs_does_not_block_another_thread() -> None:
    """A static cache's step is prepared (generate's ``prepare_inputs_for_generation``) before its forward runs; if
    that forward never comes (generate raised in between, or the caller dropped the inputs), another thread's
    generate() must still run, and give its serial tokens. The thread gets a timeout: a held lock would hang it."""
    model = tiny_model("llama")
    prompts = _prompts()
    serial = _generate(model, prompts[1], RopeKVCache(model, **OPTIONS, static=True))
    dropped = RopeKVCache(model, **OPTIONS, static=True)
    inputs = model.prepare_inputs_for_generation(prompts[0], attention_mask=torch.ones_like(prompts[0]),
                                                 **{_compat.cache_kwarg(model): dropped})
    # The step was prepared: the layers count the prompt as arriving, and until its forward ends the cache reports
    # the tokens before it (the model places the new tokens from that).
    assert dropped.layers[0].tokens_seen == 12 and dropped.get_seq_length() == 0
    del inputs
    result: list = []
    thread = threading.Thread(
        target=lambda: result.append(_generate(model, prompts[1], RopeKVCache(model, **OPTIONS, static=True))),
        daemon=True,  # if it hangs, it must not keep the test process alive
    )
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "another thread's generate() waited for a step that never ran"
    assert torch.equal(result[0], serial)
    assert torch.equal(_generate(model, prompts[1], RopeKVCache(model, **OPTIONS, static=True)), serial)


def test_two_threads_through_the_graphed_step_executor_get_their_serial_tokens(monkeypatch) -> None:
    """On one CUDA device a static cache's decode steps go through the graphed-step executor, which routes the
    model's forward to its replay while a step runs (``adapter.graphed_step``): only the calling thread's step may
    take that route, and the model must get its own forward back after. On the CPU the executor is reached by
    telling the cache's attachment that the model is capturable (private: ``adapter.attach.not_capturable``); it
    then finds the CPU, warns once per cache and runs each step eagerly through the same route."""
    from hf_ropekv.adapter import attach

    monkeypatch.setattr(attach, "not_capturable", lambda model, device: None)
    model = tiny_model("llama")
    prompts = _prompts()

    def run(prompt: torch.Tensor) -> torch.Tensor:
        cache = RopeKVCache(model, **OPTIONS, static=True)
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False,
                              pad_token_id=0, compile_config=compiled(), **{_compat.cache_kwarg(model): cache})

    with pytest.warns(hf_ropekv.HfRopeKVWarning, match="decodes eagerly, without CUDA graphs: the model runs on cpu"):
        serial = [run(prompt) for prompt in prompts]
    assert all(torch.equal(s, _generate(model, p, RopeKVCache(model, **OPTIONS))) for s, p in zip(serial, prompts))
    for _ in range(3):
        with pytest.warns(hf_ropekv.HfRopeKVWarning, match="runs on cpu"):
            got = _in_two_threads(lambda i: run(prompts[i]))
        for mine, want in zip(got, serial):
            assert torch.equal(mine, want)
    assert "forward" not in vars(model)
