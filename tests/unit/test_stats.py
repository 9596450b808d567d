"""FrequencyStats files and compatibility checks, and FrequencyAccumulator arithmetic against hand-written means.

(The import of the TriAttention reference's ``.pt`` statistics files went with ``FrequencyStats.from_reference_pt``:
statistics files are safetensors written by ``FrequencyStats.save`` only.)
"""

from __future__ import annotations

import pickle
import traceback

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config, StableLmConfig

from hf_ropekv.model.geometry import describe
from hf_ropekv.statistics.frequency_stats import FrequencyAccumulator, FrequencyStats


def _qwen3_config(**overrides) -> Qwen3Config:
    kwargs = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    )
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


def _random_stats(geometry, seed: int = 0) -> FrequencyStats:
    acc = FrequencyAccumulator(geometry)
    gen = torch.Generator().manual_seed(seed)
    for layer in range(geometry.num_layers):
        acc.add(layer, torch.randn(2, 5, geometry.num_q_heads, geometry.head_dim, generator=gen) + 0.3)
    return acc.to_stats(source="random test queries")


def _hand_stats(queries: torch.Tensor, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Means over the token dim of ``queries [N, H, D]`` with q_f = q[f] + i q[f + pairs], in float64."""
    q = queries.double()
    z = torch.complex(q[..., :pairs], q[..., pairs : 2 * pairs])
    return z.mean(0), z.abs().mean(0)


# ---------------------------------------------------------------------- accumulator
def test_accumulator_matches_hand_means_and_excludes_padding():
    geometry = describe(_qwen3_config())
    pairs = geometry.rotary_dim // 2
    gen = torch.Generator().manual_seed(1)
    acc = FrequencyAccumulator(geometry)
    kept = {0: [], 1: []}
    for step in range(2):
        q = torch.randn(3, 7, 4, 32, generator=gen) * 2 + 1
        mask = torch.rand(3, 7, generator=gen) > 0.3
        mask[0, 0] = True
        q[~mask] = float("nan")  # padding must not leak in, even as NaN
        for layer in (0, 1):
            acc.add(layer, q.to(torch.bfloat16 if step else torch.float32), mask)
            kept[layer].append(q.to(torch.bfloat16 if step else torch.float32)[mask])
    stats = acc.to_stats(source="unit test")
    for layer in (0, 1):
        mean, abs_mean = _hand_stats(torch.cat(kept[layer]), pairs)
        q_mean, q_abs_mean = stats.for_layer(layer)
        assert q_mean.dtype == torch.complex64 and q_abs_mean.dtype == torch.float32
        torch.testing.assert_close(q_mean, mean.to(torch.complex64), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(q_abs_mean, abs_mean.float(), rtol=1e-5, atol=1e-6)
    assert stats.tokens == acc.tokens == sum(len(k) for k in kept[0])
    assert stats.metadata["source"] == "unit test"


def test_accumulator_partial_rotary_pairs_f_with_f_plus_half_rotary_dim():
    config = StableLmConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.5,
    )
    geometry = describe(config)
    assert (geometry.head_dim, geometry.rotary_dim) == (16, 8)
    q = torch.randn(2, 6, 4, 16)
    acc = FrequencyAccumulator(geometry)
    acc.add(0, q)
    stats = acc.to_stats(source="unit test")
    mean, abs_mean = _hand_stats(q.flatten(0, 1), pairs=4)  # only dims 0..7, pair f with f + 4
    assert stats.q_mean.shape == (1, 4, 4)
    torch.testing.assert_close(stats.q_mean[0], mean.to(torch.complex64))
    torch.testing.assert_close(stats.q_abs_mean[0], abs_mean.float())


def test_accumulator_refuses_missing_layers_and_bad_shapes():
    geometry = describe(_qwen3_config())
    acc = FrequencyAccumulator(geometry)
    acc.add(0, torch.randn(1, 3, 4, 32))
    assert acc.tokens == 0  # layer 1 saw nothing yet
    with pytest.raises(ValueError, match=r"layers \[1\]"):
        acc.to_stats(source="x")
    with pytest.raises(ValueError, match="4 heads"):
        acc.add(1, torch.randn(1, 3, 2, 32))
    with pytest.raises(ValueError, match="mask"):
        acc.add(1, torch.randn(1, 3, 4, 32), torch.ones(1, 4, dtype=torch.bool))


def test_save_load_round_trip_is_exact(tmp_path):
    geometry = describe(_qwen3_config())
    stats = _random_stats(geometry)
    path = tmp_path / "stats.safetensors"
    stats.save(path)
    loaded = FrequencyStats.load(path)
    assert torch.equal(loaded.q_mean, stats.q_mean) and torch.equal(loaded.q_abs_mean, stats.q_abs_mean)
    assert loaded.q_mean.dtype == torch.complex64 and loaded.q_abs_mean.dtype == torch.float32
    assert loaded.metadata == {**stats.metadata, "format_version": 1}
    for key in ("model_type", "num_layers", "num_q_heads", "num_kv_heads", "head_dim", "rotary_dim", "rope_type",
                "rope_theta", "rope_parameters", "inv_freq", "tokens", "source", "format_version"):
        assert key in loaded.metadata
    assert loaded.tokens == 10 and loaded.metadata["source"] == "random test queries"
    assert torch.equal(torch.tensor(loaded.metadata["inv_freq"]), geometry.inv_freq)
    resolved = FrequencyStats.resolve(str(path), geometry)
    assert torch.equal(resolved.q_mean, stats.q_mean)
    assert FrequencyStats.resolve(stats, geometry) is stats


@pytest.mark.parametrize(
    "other, expected",
    [
        (_qwen3_config(num_attention_heads=8), ["query heads", "tensor shape"]),
        (_qwen3_config(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), ["rope theta", "inv_freq"]),
        (
            LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32),
            ["model type"],
        ),
    ],
    ids=["heads", "rope_theta", "model_type"],
)
def test_mismatched_statistics_are_refused_with_the_mismatch_named(tmp_path, other, expected):
    stats = _random_stats(describe(_qwen3_config()))
    path = tmp_path / "stats.safetensors"
    stats.save(path)
    with pytest.raises(ValueError) as err:
        FrequencyStats.resolve(path, describe(other))
    message = str(err.value)
    for name in expected:
        assert name in message
    assert "hf_ropekv.calibrate" in message


def test_load_refuses_files_that_are_not_statistics(tmp_path):
    bad = tmp_path / "junk.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="could not be read as a safetensors file of hf_ropekv query statistics"):
        FrequencyStats.load(bad)
    with pytest.raises(FileNotFoundError, match="hf_ropekv.calibrate"):
        FrequencyStats.resolve(tmp_path / "missing.safetensors", describe(_qwen3_config()))


# ---------------------------------------------------------------------- rotary layout
def _cohere_config(**overrides):
    from transformers import CohereConfig

    kwargs = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    kwargs.update(overrides)
    return CohereConfig(**kwargs)


def test_accumulator_pairs_dims_as_the_model_does():
    """Interleaved models (Cohere): q_f = q[2f] + i q[2f + 1], written out here by index."""
    geometry = describe(_cohere_config())
    assert geometry.rotary_layout == "interleaved"
    pairs = geometry.rotary_dim // 2
    q = torch.randn(2, 6, geometry.num_q_heads, geometry.head_dim, generator=torch.Generator().manual_seed(4)) + 0.5
    acc = FrequencyAccumulator(geometry)
    for layer in range(geometry.num_layers):
        acc.add(layer, q)
    stats = acc.to_stats(source="unit test")
    assert stats.metadata["rotary_layout"] == "interleaved"
    flat = q.flatten(0, 1).double()
    z = torch.complex(flat[..., [2 * f for f in range(pairs)]], flat[..., [2 * f + 1 for f in range(pairs)]])
    torch.testing.assert_close(stats.q_mean[0], z.mean(0).to(torch.complex64), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats.q_abs_mean[1], z.abs().mean(0).float(), rtol=1e-5, atol=1e-6)


def test_layout_is_recorded_and_checked_on_load(tmp_path):
    cohere = describe(_cohere_config())
    stats = _random_stats(cohere)
    stats.save(tmp_path / "cohere.safetensors")
    loaded = FrequencyStats.load(tmp_path / "cohere.safetensors")
    assert loaded.metadata["rotary_layout"] == "interleaved"
    loaded.check_compatible(cohere)
    # The same statistics claimed by a rotate_half model of the same shape are refused, naming the layout.
    loaded.metadata["rotary_layout"] = "rotate_half"
    with pytest.raises(ValueError, match="rotary pair layout"):
        loaded.check_compatible(cohere)
    # Files written before the field existed were rotate_half: fine for rotate_half models, refused otherwise.
    del loaded.metadata["rotary_layout"]
    with pytest.raises(ValueError, match="rotary pair layout: statistics have 'rotate_half'"):
        loaded.check_compatible(cohere)
    qwen3 = describe(_qwen3_config())
    old = _random_stats(qwen3)
    del old.metadata["rotary_layout"]
    old.save(tmp_path / "old.safetensors")
    FrequencyStats.load(tmp_path / "old.safetensors").check_compatible(qwen3)


# ---------------------------------------------------------------------- tensor parallelism
def test_accumulator_takes_a_tensor_parallel_share_of_the_heads():
    """Under tp_plan="auto" a rank's attention shows num_heads / world query heads."""
    geometry = describe(_qwen3_config())  # 4 query heads
    acc = FrequencyAccumulator(geometry)
    q = torch.randn(2, 5, 2, geometry.head_dim, generator=torch.Generator().manual_seed(2))
    for layer in range(geometry.num_layers):
        acc.add(layer, q)
    assert acc.to_stats(source="rank share").q_mean.shape == (2, 2, geometry.rotary_dim // 2)
    with pytest.raises(ValueError, match="2 heads"):
        acc.add(0, torch.randn(2, 5, 4, geometry.head_dim))  # then the whole model's heads: inconsistent
    with pytest.raises(ValueError, match="heads"):
        FrequencyAccumulator(geometry).add(0, torch.randn(2, 5, 3, geometry.head_dim))  # 3 does not divide 4


def test_scorer_slices_whole_model_statistics_to_the_local_kv_heads(monkeypatch):
    """Private: the scorer's slicing helper, called with a faked torch.distributed rank (no second process here; the
    tensor-parallel run itself is tests/integration/test_check_tp.py)."""
    from hf_ropekv.scorers import frequency

    stats = _random_stats(describe(_qwen3_config()))  # 4 query heads, 2 KV heads
    q_mean, q_abs = stats.for_layer(0)
    same = frequency._heads_of_this_rank(q_mean, q_abs, 2, stats.metadata)
    assert same[0] is q_mean
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    for rank in (0, 1):
        monkeypatch.setattr(torch.distributed, "get_rank", lambda rank=rank: rank)
        local_mean, local_abs = frequency._heads_of_this_rank(q_mean, q_abs, 1, stats.metadata)
        share = slice(2 * rank, 2 * rank + 2)
        assert torch.equal(local_mean, q_mean[share]) and torch.equal(local_abs, q_abs[share])
    # Statistics gathered on the rank (online) already hold its share.
    assert frequency._heads_of_this_rank(q_mean[:2], q_abs[:2], 1, stats.metadata)[0].shape[0] == 2


# ---------------------------------------------------------------------- untrusted files
class _NotATensor:
    """A class torch's weights-only unpickler refuses: a file holding it could run code when unpickled freely."""


def _whole_report(err: BaseException) -> str:
    """What the user sees: the message and every chained exception in the traceback."""
    return "".join(traceback.format_exception(err))


def _assert_refused_safely(err: BaseException, path) -> None:
    report = _whole_report(err)
    assert str(path) in str(err), "the message names the file"
    assert "hf_ropekv.calibrate" in str(err), "the message says how to make a good file"
    assert "weights_only=False" not in report, "never advise unpickling a file of unknown origin"


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(lambda path: path.write_bytes(b"\x80\x04garbage that is no pickle"), id="garbage"),
        pytest.param(lambda path: torch.save({"stats": {"layer00_head00": _NotATensor()}}, path), id="code-object"),
        pytest.param(lambda path: path.write_bytes(pickle.dumps(_NotATensor())), id="plain-pickle"),
        pytest.param(lambda path: torch.save({"q_mean_real": torch.randn(2, 4, 16)}, path), id="torch-save"),
    ],
)
def test_a_pickle_file_is_refused_without_unsafe_advice(tmp_path, content):
    """Statistics are safetensors only: a pickle (``torch.save``, a code object, garbage) is never unpickled, and the
    error names the file and the fix, not ``weights_only=False``."""
    path = tmp_path / "stats.pt"
    content(path)
    geometry = describe(_qwen3_config())
    for read in (lambda: FrequencyStats.resolve(path, geometry), lambda: FrequencyStats.load(path)):
        with pytest.raises(ValueError, match="could not be read as a safetensors file of hf_ropekv") as err:
            read()
        _assert_refused_safely(err.value, path)


def test_corrupt_safetensors_file_names_the_file_and_the_fix(tmp_path):
    good = tmp_path / "good.safetensors"
    _random_stats(describe(_qwen3_config())).save(good)
    geometry = describe(_qwen3_config())
    for name, data in [("garbage", b"\xff" * 64), ("truncated", good.read_bytes()[:-40])]:
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(data)
        with pytest.raises(ValueError, match="could not be read as a safetensors file of hf_ropekv") as err:
            FrequencyStats.resolve(path, geometry)
        _assert_refused_safely(err.value, path)


def test_missing_statistics_file_is_named_everywhere(tmp_path):
    geometry = describe(_qwen3_config())
    for path in (tmp_path / "absent.safetensors", tmp_path / "absent.pt"):
        for read in (
            lambda: FrequencyStats.load(path),
            lambda: FrequencyStats.resolve(path, geometry),
        ):
            with pytest.raises(FileNotFoundError, match="hf_ropekv.calibrate") as err:
                read()
            assert str(path) in str(err.value)


def test_statistics_of_another_model_are_refused_naming_the_mismatch(tmp_path):
    """A well-formed file of another geometry (here: another head count) is refused, not silently used."""
    path = tmp_path / "other.safetensors"
    _random_stats(describe(_qwen3_config(num_attention_heads=8, num_key_value_heads=2, head_dim=16))).save(path)
    with pytest.raises(ValueError, match="query heads: statistics have 8, the model has 4") as err:
        FrequencyStats.resolve(path, describe(_qwen3_config()))
    assert "hf_ropekv.calibrate" in str(err.value)


def test_loaded_statistics_do_not_change_with_the_file(tmp_path):
    path = tmp_path / "stats.safetensors"
    stats = _random_stats(describe(_qwen3_config()))
    stats.save(path)
    loaded = FrequencyStats.load(path)
    size = path.stat().st_size
    with open(path, "r+b") as f:  # rewritten in place, same size (no truncation: a truncated map may SIGBUS)
        f.write(bytes(size))
    assert torch.equal(loaded.q_mean, stats.q_mean)
    assert torch.equal(loaded.q_abs_mean, stats.q_abs_mean)
