"""No ``past_key_values`` deprecation from hf_ropekv's code or documented snippets (transformers 5.24 renamed it
to ``cache``; 5.17-5.23 only know ``past_key_values``).

5.24 reports the old name two ways: ``generate(past_key_values=...)`` and ``forward(past_key_values=...)`` raise
a ``FutureWarning``; ``output.past_key_values`` (and internal renames) log "deprecated. Use `cache` instead." once
per process. Both count as failures here.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
import warnings
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from transformers.utils import logging as hf_logging

import hf_ropekv
from hf_ropekv import RopeKVCache, _compat

README = Path(__file__).resolve().parents[1] / "README.md"
NEW_KEYWORD = _compat.cache_kwarg(tiny_model("llama")) == "cache"


class _Deprecations(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "past_key_values" in message and "deprecated" in message:
            self.messages.append(message)


@contextlib.contextmanager
def no_cache_deprecation():
    """FutureWarnings become errors; transformers' logged cache-keyword deprecation fails on exit."""
    hf_logging.warning_once.cache_clear()  # logged once per process: make it observable again
    handler = _Deprecations()
    root = hf_logging.get_logger("transformers")
    root.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            yield
    finally:
        root.removeHandler(handler)
    assert handler.messages == [], handler.messages


@pytest.fixture
def no_deprecation():
    with no_cache_deprecation():
        yield


def test_the_check_catches_the_old_keyword() -> None:
    """Both detectors fire on the old keyword where it is deprecated (else the tests below are vacuous)."""
    if not NEW_KEYWORD:
        pytest.skip("transformers before 5.24 takes only past_key_values=")
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    with pytest.raises(FutureWarning), no_cache_deprecation():
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=RopeKVCache(model), max_new_tokens=2)
    with pytest.raises(FutureWarning), no_cache_deprecation(), torch.no_grad():
        model(ids, past_key_values=RopeKVCache(model))
    with pytest.raises(AssertionError, match="deprecated"), no_cache_deprecation(), torch.no_grad():
        model(ids, cache=RopeKVCache(model)).past_key_values  # the old output attribute is logged instead


def readme_snippets() -> list[str]:
    """The README's python blocks that pass a cache to generate (the signature listing is not code to run;
    a snippet that goes through ``hf_ropekv.enable`` passes none)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    return [block for block in blocks if "generate(" in block and "cache" in re.sub(r"hf_ropekv\.\w+", "", block)]


class _Tokenizer:
    """Just what the multi-turn snippet calls: ``tokenizer(text, return_tensors="pt", ...).input_ids``."""

    def __call__(self, text: str, **kwargs):
        ids = torch.tensor([[3 + ord(c) % 100 for c in text]])
        return type("Encoding", (), {"input_ids": ids})()


def test_readme_snippets_run_without_deprecation(no_deprecation, monkeypatch) -> None:
    # The compile-cache snippet needs a CUDA compile to have anything to save; its calls are checked in
    # test_compile_cache.py, so here they only record that the snippet makes them after its generate().
    shipped: list[str] = []
    for name in ("save_compile_artifacts", "load_compile_artifacts", "read_compile_artifacts"):
        monkeypatch.setattr(hf_ropekv, name, lambda *args, _name=name, **kwargs: shipped.append(_name))
    snippets = readme_snippets()
    assert len(snippets) >= 2 and all("cache=cache" in s for s in snippets)
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    namespace = dict(
        model=model, inputs=dict(input_ids=ids, attention_mask=torch.ones_like(ids)), torch=torch,
        tokenizer=_Tokenizer(), next_user_message="and then?",
        batches=[dict(input_ids=ids, attention_mask=torch.ones_like(ids))] * 2,  # the workload-statistics loop
    )
    for snippet in snippets:
        namespace["cache"] = RopeKVCache(model, budget=64)  # snippets that use `cache` without building one
        code = re.sub(r"max_new_tokens=\d+", "max_new_tokens=4", snippet)
        if not NEW_KEYWORD:  # as the README says: 5.17-5.23 take past_key_values=
            code = re.sub(r"(?<![\w.])cache=cache", "past_key_values=cache", code)
        exec(compile(code, str(README), "exec"), namespace)
        assert namespace["cache"].tokens_seen > ids.shape[1]
    assert shipped == ["save_compile_artifacts", "load_compile_artifacts", "read_compile_artifacts"]


def test_library_paths_without_deprecation(no_deprecation) -> None:
    """Every way hf_ropekv itself calls the model or its cache: enable, calibrate, attached caches, copies, crop."""
    model = tiny_model("qwen3")
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    kwarg = _compat.cache_kwarg(model)
    kw = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)

    with hf_ropekv.enabled(model, budget=16, compress_every=4):
        model.generate(ids, **kw)
    stats = hf_ropekv.calibrate(model, None, ids[0], progress=False)
    cache = RopeKVCache(model, budget=16, compress_every=4, stats=stats)
    out = model.generate(ids, **{kwarg: cache}, **kw)
    assert cache.evicted
    more = torch.cat([out, out[:, -3:]], dim=1)
    more_mask = torch.cat([mask, torch.ones(2, more.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
    model.generate(more, **{kwarg: copy.deepcopy(cache)}, **{**kw, "attention_mask": more_mask})

    single = RopeKVCache(model)
    model.generate(ids[:1], **{kwarg: single}, **{**kw, "attention_mask": mask[:1]}, prompt_lookup_num_tokens=2)
    with torch.no_grad():
        model(ids[:1, :4], **{kwarg: RopeKVCache(model)})
