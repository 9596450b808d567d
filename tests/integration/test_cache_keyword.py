"""No ``past_key_values`` deprecation from hf_ropekv's own code (transformers 5.24 renamed it to ``cache``; 5.17-5.23
only know ``past_key_values``), and README snippets that use the current API.

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

README = Path(__file__).resolve().parents[2] / "README.md"
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


def readme_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_snippets_use_the_current_api() -> None:
    """The README's python blocks (read, not run: they load models from the hub) import only names hf_ropekv has,
    and pass RopeKVCache / enable / enabled only options they take. (Which keyword hands generate() the cache is
    the README's choice: ``past_key_values=`` works on every supported version, with a FutureWarning from 5.24.)"""
    import ast
    import importlib

    from hf_ropekv.cache.options import OPTION_NAMES

    blocks = readme_blocks()
    assert blocks, "no python block in the README"
    problems = []
    for block in blocks:
        try:
            tree = ast.parse(block)
        except SyntaxError:  # a signature listing, not code
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hf_ropekv":
                module = importlib.import_module(node.module)
                problems += [f"from {node.module} import {a.name}" for a in node.names if not hasattr(module, a.name)]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "hf_ropekv":
                if not hasattr(hf_ropekv, node.attr):
                    problems.append(f"hf_ropekv.{node.attr}")
            elif isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                keywords = {k.arg for k in node.keywords if k.arg is not None}
                if name in ("RopeKVCache", "enable", "enabled"):
                    problems += [f"{name}({k}=...)" for k in keywords - set(OPTION_NAMES) - {"budget"}]
    assert problems == [], problems


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
    cache = RopeKVCache(model, budget=16, compress_every=4, scorer=hf_ropekv.FrequencyScorer(stats=stats))
    out = model.generate(ids, **{kwarg: cache}, **kw)
    assert cache.evicted
    more = torch.cat([out, out[:, -3:]], dim=1)
    more_mask = torch.cat([mask, torch.ones(2, more.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
    model.generate(more, **{kwarg: copy.deepcopy(cache)}, **{**kw, "attention_mask": more_mask})

    single = RopeKVCache(model)
    model.generate(ids[:1], **{kwarg: single}, **{**kw, "attention_mask": mask[:1]}, prompt_lookup_num_tokens=2)
    with torch.no_grad():
        model(ids[:1, :4], **{kwarg: RopeKVCache(model)})
