"""Compile artifacts saved after a warm run and loaded in a fresh process (``hf_ropekv.compile_cache``).

The round trip compiles a tiny model's static decode step with inductor on the CPU in one subprocess, saves the
artifacts, and loads them in a second subprocess whose inductor cache folder is empty: the second compile must
find its graph in the loaded artifacts (torch's cache-hit counters), which is what a fresh GPU machine gets. The
other tests write headers by hand and replace torch's loader, so they compile nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import hf_ropekv
from hf_ropekv import (
    CompileArtifactsInfo,
    CompileArtifactsMismatchError,
    HfRopeKVWarning,
    load_compile_artifacts,
    read_compile_artifacts,
    save_compile_artifacts,
)
from hf_ropekv import compile_cache

from conftest import tiny_model

REPO = Path(__file__).resolve().parents[1]

# Compiles the static decode step inside generate (inductor, CPU), then prints torch's cache counters as JSON.
_ROUND_TRIP = textwrap.dedent(
    """
    import json, sys
    import torch
    sys.path.insert(0, {tests!r})
    from conftest import tiny_model
    from transformers import CompileConfig
    import hf_ropekv
    from hf_ropekv._compat import cache_kwarg
    from torch._dynamo.utils import counters

    mode, path = sys.argv[1], sys.argv[2]
    model = tiny_model("qwen3", num_hidden_layers=1)
    loaded = None
    if mode == "load":
        loaded = hf_ropekv.load_compile_artifacts(path, strict=True, model=model)
    cache = hf_ropekv.RopeKVCache(model, budget=8, compress_every=4, static=True, protect_prompt=False)
    config = CompileConfig(backend="inductor", fullgraph=True, mode=None)
    config._compile_all_devices = True  # generate compiles by itself on accelerators only
    ids = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                   compile_config=config, **{{cache_kwarg(model): cache}})
    if mode == "save":
        info = hf_ropekv.save_compile_artifacts(path, model=model, cache=cache, extra={{"context": 20}})
        assert info.artifacts, info
    print(json.dumps(dict(
        fxgraph_hit=counters["inductor"]["fxgraph_cache_hit"],
        fxgraph_miss=counters["inductor"]["fxgraph_cache_miss"],
        aot_hit=counters["aot_autograd"]["autograd_cache_hit"],
        graphs=counters["stats"]["unique_graphs"],
        loaded=None if loaded is None else loaded.artifacts,
    )))
    """
)


def _compile_in_fresh_process(mode: str, artifacts: Path, cache_dir: Path) -> dict[str, Any]:
    script = cache_dir.parent / f"{mode}.py"
    script.write_text(_ROUND_TRIP.format(tests=str(REPO / "tests")))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=str(cache_dir),
               TRITON_CACHE_DIR=str(cache_dir / "triton"), TORCHINDUCTOR_FX_GRAPH_CACHE="1")
    proc = subprocess.run([sys.executable, str(script), mode, str(artifacts)], capture_output=True, text=True,
                          timeout=400, env=env, cwd=REPO)
    assert proc.returncode == 0, f"{mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_artifacts_saved_after_a_warm_run_are_hit_in_a_fresh_process_with_empty_caches(tmp_path: Path) -> None:
    artifacts = tmp_path / "step.ropekv-compile"
    cold = _compile_in_fresh_process("save", artifacts, tmp_path / "cache_a")
    assert cold["graphs"] == 1 and cold["fxgraph_miss"] >= 1 and cold["fxgraph_hit"] == 0
    info = read_compile_artifacts(artifacts)
    assert info.model["budget"] == 8 and info.model["num_hidden_layers"] == 1 and info.model["context"] == 20
    assert info.device_name == "cpu" and info.artifacts.get("inductor", 0) >= 1

    fresh = _compile_in_fresh_process("load", artifacts, tmp_path / "cache_b")  # another, empty, cache folder
    assert fresh["loaded"] and fresh["loaded"].get("inductor", 0) >= 1
    assert fresh["graphs"] == 1 and fresh["fxgraph_hit"] >= 1 and fresh["fxgraph_miss"] == 0
    assert fresh["aot_hit"] >= 1


# ---------------------------------------------------------------------------------------------- headers by hand
PAYLOAD = b"not really torch's artifacts, but bytes all the same"


class _FakeTorchCache:
    """Stands in for torch.compiler's save/load, recording what was handed to the loader."""

    def __init__(self) -> None:
        self.loaded: list[bytes] = []

    def save(self) -> tuple[bytes, Any]:
        from torch.compiler._cache import CacheInfo

        info = CacheInfo()
        info.artifacts["inductor"].append("graph-key")
        info.artifacts["aot_autograd"].append("aot-key")
        return PAYLOAD, info

    def load(self, payload: bytes) -> None:
        self.loaded.append(payload)


@pytest.fixture
def fake_torch_cache(monkeypatch: pytest.MonkeyPatch) -> _FakeTorchCache:
    fake = _FakeTorchCache()
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", fake.save)
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", fake.load)
    return fake


def _rewrite_header(path: Path, **changes: Any) -> None:
    """Change header fields of a saved file in place (the payload and its checksum stay valid)."""
    data = path.read_bytes()
    start = len(compile_cache.MAGIC) + compile_cache._LENGTH.size
    length = compile_cache._LENGTH.unpack(data[len(compile_cache.MAGIC):start])[0]
    header = json.loads(data[start:start + length])
    header.update(changes)
    encoded = json.dumps(header).encode()
    path.write_bytes(compile_cache.MAGIC + compile_cache._LENGTH.pack(len(encoded)) + encoded + data[start + length:])


def test_the_header_describes_versions_device_and_workload_without_loading(
        tmp_path: Path, fake_torch_cache: _FakeTorchCache) -> None:
    import transformers

    model = tiny_model("qwen3")
    cache = hf_ropekv.RopeKVCache(model, budget=16, compress_every=4)
    path = tmp_path / "a.ropekv-compile"
    written = save_compile_artifacts(path, model=model, cache=cache, extra={"context": 4096})
    info = read_compile_artifacts(path)
    assert isinstance(info, CompileArtifactsInfo) and info == written and not fake_torch_cache.loaded
    assert (info.torch, info.transformers, info.hf_ropekv) == (torch.__version__, transformers.__version__,
                                                               hf_ropekv.__version__)
    assert info.device_name == "cpu" and info.device_capability is None and info.format_version == 1
    assert info.artifacts == {"inductor": 1, "aot_autograd": 1} and info.artifact_bytes == len(PAYLOAD)
    assert info.model["model_type"] == "qwen3" and info.model["dtype"] == "float32"
    assert info.model["budget"] == 16 and info.model["compress_every"] == 4 and info.model["context"] == 4096
    assert info.mismatches() == []


def test_a_matching_file_is_handed_to_torch(tmp_path: Path, fake_torch_cache: _FakeTorchCache) -> None:
    path = tmp_path / "a.ropekv-compile"
    save_compile_artifacts(path)
    info = load_compile_artifacts(path, strict=True)
    assert info is not None and fake_torch_cache.loaded == [PAYLOAD]


def test_other_versions_warn_and_load_nothing_and_strict_raises_naming_them(
        tmp_path: Path, fake_torch_cache: _FakeTorchCache) -> None:
    path = tmp_path / "a.ropekv-compile"
    save_compile_artifacts(path)
    _rewrite_header(path, torch="2.0.0+cu118", device_name="NVIDIA H200", device_capability="9.0")
    with pytest.warns(HfRopeKVWarning, match=r"torch: file has '2\.0\.0\+cu118'.*device_name: file has 'NVIDIA H200'"):
        assert load_compile_artifacts(path) is None
    assert fake_torch_cache.loaded == []
    with pytest.raises(CompileArtifactsMismatchError, match=r"device_capability: file has '9\.0', running None"):
        load_compile_artifacts(path, strict=True)
    assert fake_torch_cache.loaded == []
    assert read_compile_artifacts(path).torch == "2.0.0+cu118"  # the header still reads


def test_another_workload_loads_with_a_warning(tmp_path: Path, fake_torch_cache: _FakeTorchCache) -> None:
    model = tiny_model("qwen3")
    path = tmp_path / "a.ropekv-compile"
    save_compile_artifacts(path, model=model, cache=hf_ropekv.RopeKVCache(model, budget=16, compress_every=4))
    with pytest.warns(HfRopeKVWarning, match="budget: file has 16, here 32"):
        assert load_compile_artifacts(path, cache=hf_ropekv.RopeKVCache(model, budget=32, compress_every=4))
    assert fake_torch_cache.loaded == [PAYLOAD]


def test_foreign_damaged_and_truncated_files_are_errors_even_when_not_strict(
        tmp_path: Path, fake_torch_cache: _FakeTorchCache) -> None:
    foreign = tmp_path / "foreign.bin"
    foreign.write_bytes(b"\x80\x04 pickled or raw torch artifacts")
    with pytest.raises(ValueError, match="not an hf_ropekv compile-artifacts file"):
        load_compile_artifacts(foreign)
    with pytest.raises(ValueError, match="not an hf_ropekv compile-artifacts file"):
        read_compile_artifacts(foreign)

    good = tmp_path / "good.ropekv-compile"
    save_compile_artifacts(good)
    data = good.read_bytes()
    truncated = tmp_path / "truncated.ropekv-compile"
    truncated.write_bytes(data[:-5])
    with pytest.raises(ValueError, match="truncated or damaged"):
        load_compile_artifacts(truncated)
    flipped = tmp_path / "flipped.ropekv-compile"
    flipped.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    with pytest.raises(ValueError, match="checksum"):
        load_compile_artifacts(flipped)
    cut_header = tmp_path / "cut.ropekv-compile"
    cut_header.write_bytes(data[: len(compile_cache.MAGIC) + 12])
    with pytest.raises(ValueError, match="header"):
        read_compile_artifacts(cut_header)
    newer = tmp_path / "newer.ropekv-compile"
    newer.write_bytes(data)
    _rewrite_header(newer, format_version=99)
    with pytest.raises(ValueError, match="format 99"):
        load_compile_artifacts(newer)
    assert fake_torch_cache.loaded == []


def test_saving_before_anything_compiled_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None)
    with pytest.raises(RuntimeError, match="no compile artifacts to save"):
        save_compile_artifacts(tmp_path / "none.ropekv-compile")
    assert not (tmp_path / "none.ropekv-compile").exists()
