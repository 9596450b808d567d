#!/usr/bin/env python
"""Probe: a static RopeKVCache's decode step recorded as a CUDA graph of the *eager* forward, without torch.compile.

Issue 27's warm-up is torch.compile's: dynamo's trace of the model (5.7 s in a second process on the H200, which no
disk cache keeps) and, cold, inductor's code generation (~30 s). A static cache's decode step reads only fixed
buffers (its arenas, its step clock, its statistics: ``hf_ropekv.storage.buffers``) and gets its per-step values from
generate's inputs (ids, positions, the 4-D slot mask the cache builds eagerly before the step). So the eager forward
itself can be recorded once as a CUDA graph and replayed: no trace, no code generation, and the same kernels as
eager, so the same tokens. What it costs is the eager kernels' count (no fusion): does the step stay fast?

How the probe wires it (no library change): before the cache is built, ``model.get_compiled_call`` is set to return
:class:`GraphedForward`; the cache's own ``get_compiled_call`` wrapper chains to it, so generate's decode steps call
it where they would call the compiled forward (multi-token forwards stay eager, as with compile). It runs
``model(...)`` with ``model.forward`` swapped for the replay, so the model's hooks (the cache's step preparation)
run eagerly each step, as they do around a compiled step. The first step of a new input signature or cache runs
eagerly (its real result) and is then recorded. During the capture hf_ropekv takes its compile-time paths (device
scalars for the step clock, no eager-only checks: ``hf_ropekv.storage.buffers.step_is_recorded`` sees the capture),
and transformers' mask code treats a capturing stream as tracing. The first runs (``--patch-is-compiling``) made
``torch.compiler.is_compiling`` report True during the capture instead, process-wide.

The library now has the executor itself (``RopeKVCache(..., cuda_graphs=True)``,
``hf_ropekv.hooks.graphed_step``); the parts ``graphed_lib`` and ``e2e_lib`` run it.

One process, in order: eager static steps (the reference tokens), graphed steps (same tokens?, step time),
the library's option, compiled static steps (generate's inductor + CUDA graphs, cold unless torch's caches are
warm), and end to end,
``--e2e-tokens`` with the graphed step against ``DynamicCache`` eager.

    python benchmarks/graphed_step_probe.py --out DIR [--shape qwen3-8b] [--tokens 256] [--e2e-tokens 2000]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

common.import_hf_ropekv()
# The signature and the cloning the library's executor uses (hf_ropekv.hooks.graphed_step): the probe's own
# executor below is the one the first runs used, kept to reproduce them.
from hf_ropekv.hooks.graphed_step import clone_tensors as clone, input_signature as signature  # noqa: E402
from hf_ropekv.hooks.graphed_step import tensor_leaves as tensors  # noqa: E402

_MISSING = object()


class GraphedForward:
    """Replays a model's decode steps from CUDA graphs of its eager forward, one graph per input signature and cache."""

    def __init__(self, model: torch.nn.Module, patch_is_compiling: bool = False) -> None:
        self.model = model
        self.patch_is_compiling = patch_is_compiling
        self.graphs: dict[Any, Any] = {}
        self.recorded = 0
        self.record_s: list[float] = []
        self.stream: torch.cuda.Stream | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        previous = model.__dict__.get("forward", _MISSING)
        real = previous if previous is not _MISSING else types.MethodType(type(model).forward, model)
        model.forward = functools.partial(self._forward, real)  # model.__call__'s hooks stay eager
        try:
            return model(*args, **kwargs)
        finally:
            if previous is _MISSING:
                del model.forward
            else:
                model.forward = previous

    def _forward(self, real: Any, *args: Any, **kwargs: Any) -> Any:
        key = signature(args, kwargs)
        entry = self.graphs.get(key)
        if entry is None:
            t0 = time.perf_counter()
            output, entry = self._record(real, args, kwargs)
            self.graphs[key] = entry
            self.recorded += 1
            torch.cuda.synchronize()
            self.record_s.append(time.perf_counter() - t0)
            return output
        graph, static_args, static_kwargs, static_output = entry
        for static, new in zip(tensors(static_args, static_kwargs), tensors(args, kwargs)):
            static.copy_(new)
        graph.replay()
        return type(static_output)(**{k: clone(v) for k, v in static_output.items()})

    def _record(self, real: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple]:
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            output = real(*args, **kwargs)  # the step itself, eagerly: also the warm-up the capture needs
            static_args, static_kwargs = clone_inputs(args, kwargs)
        graph = torch.cuda.CUDAGraph()
        is_compiling = torch.compiler.is_compiling
        if self.patch_is_compiling:  # every torch.compile path of hf_ropekv and transformers, process-wide
            torch.compiler.is_compiling = lambda: True
        try:  # else hf_ropekv sees the capture itself (storage.buffers.step_is_recorded), transformers' masks too
            with torch.cuda.graph(graph, stream=stream):
                static_output = real(*static_args, **static_kwargs)
        finally:
            torch.compiler.is_compiling = is_compiling
        torch.cuda.current_stream().wait_stream(stream)
        return output, (graph, static_args, static_kwargs, static_output)


def clone_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return pytree.tree_map(clone, (args, kwargs))


def step_stats(steps_ms: list[float]) -> dict[str, Any]:
    later = steps_ms[1:]
    return dict(first_decode_step_ms=steps_ms[0] if steps_ms else None,
                later_p50_ms=statistics.median(later) if later else None,
                later_p10_ms=sorted(later)[len(later) // 10] if later else None,
                later_p90_ms=sorted(later)[9 * len(later) // 10] if later else None,
                later_max_ms=max(later) if later else None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--compress-every", type=int, default=128)
    p.add_argument("--tokens", type=int, default=256, help="new tokens of the eager / graphed / compiled comparison")
    p.add_argument("--e2e-tokens", type=int, default=2000)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--parts", default="eager,graphed,compiled,e2e",
                   help="of eager, graphed (the probe's executor), graphed_lib (RopeKVCache(cuda_graphs=True)), "
                        "e2e (graphed and DynamicCache), e2e_lib (static='auto', cuda_graphs=True), compiled")
    p.add_argument("--patch-is-compiling", action="store_true",
                   help="record with torch.compiler.is_compiling() reporting True (the first runs' way; since "
                        "the library asks storage.buffers.step_is_recorded, which sees a capture, not needed)")
    p.add_argument("--commit", default=None)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    torch.backends.cuda.enable_cudnn_sdp(False)
    hf_ropekv = common.import_hf_ropekv()
    from transformers import DynamicCache, LogitsProcessorList

    from hf_ropekv._compat import cache_kwarg

    device = torch.device("cuda")
    model = common.build_random_model(common.make_config(args.shape), dtype=torch.bfloat16, device=device)
    kwarg = cache_kwarg(model)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.config.vocab_size - 3, (args.batch, args.context), generator=gen).to(device)
    result: dict[str, Any] = dict(meta=common.run_metadata(device, args.commit, sys.argv), args=vars(args), runs={})
    parts = args.parts.split(",")

    def run(name: str, cache: Any, new_tokens: int, **generate_kwargs: Any) -> torch.Tensor | None:
        try:
            return _run(name, cache, new_tokens, **generate_kwargs)
        except Exception as err:  # noqa: BLE001 - a probe: record what failed, go on with the other parts
            import traceback
            result["runs"][name] = dict(error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc()[-4000:])
            print(name, "FAILED", traceback.format_exc()[-3000:], flush=True)
            (out / "results.json").write_text(json.dumps(result, indent=2, default=str))
            return None

    keep: list[Any] = []  # caches stay alive: the probe's graphs are keyed by id(cache)

    def _run(name: str, cache: Any, new_tokens: int, **generate_kwargs: Any) -> torch.Tensor:
        keep.append(cache)
        clock = common.StepClock()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False,
                                logits_processor=LogitsProcessorList([clock]),
                                **{kwarg: cache}, **generate_kwargs)
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
        steps = [1e3 * (b - a) for a, b in zip(clock.stamps, clock.stamps[1:])]
        row = dict(total_s=total, time_to_first_token_s=clock.stamps[0] - t0,
                   new_tokens=tokens.shape[1] - prompt.shape[1],
                   **step_stats(steps), peak_allocated=torch.cuda.max_memory_allocated())
        result["runs"][name] = row
        print(name, json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
        (out / "results.json").write_text(json.dumps(result, indent=2, default=str))
        return tokens[:, prompt.shape[1]:].cpu()

    def ropekv(**options: Any) -> Any:
        return hf_ropekv.RopeKVCache(model, budget=args.budget, compress_every=args.compress_every,
                                     protect_prompt=False, static=True, **options)

    reference = None
    if "eager" in parts:  # the static cache's step without compile: the reference tokens
        reference = run("ropekv_static_eager", ropekv(), args.tokens, disable_compile=True)
    graphed = GraphedForward(model, patch_is_compiling=args.patch_is_compiling)
    model.get_compiled_call = lambda *a, **k: graphed  # the cache's get_compiled_call wrapper chains to it
    if "graphed" in parts:
        tokens = run("ropekv_static_graphed", ropekv(), args.tokens)
        if tokens is not None:
            result["runs"]["ropekv_static_graphed"].update(
                recorded=graphed.recorded, record_s=graphed.record_s,
                tokens_equal_eager=None if reference is None else bool(torch.equal(tokens, reference)),
                first_mismatch=None if reference is None or torch.equal(tokens, reference)
                else int((tokens != reference).any(0).nonzero()[0]))
            tokens2 = run("ropekv_static_graphed_second_cache", ropekv(), args.tokens)
            if tokens2 is not None:
                result["runs"]["ropekv_static_graphed_second_cache"].update(
                    recorded=graphed.recorded, tokens_equal_first=bool(torch.equal(tokens2, tokens)))
    if "graphed_lib" in parts:  # the library's executor: RopeKVCache(..., cuda_graphs=True)
        tokens = run("ropekv_static_cuda_graphs_option", ropekv(cuda_graphs=True), args.tokens)
        if tokens is not None:
            executor = vars(model)["get_compiled_call"].graphed
            result["runs"]["ropekv_static_cuda_graphs_option"].update(
                recordings=executor.recordings,
                tokens_equal_eager=None if reference is None else bool(torch.equal(tokens, reference)))
    if "e2e_lib" in parts:  # static="auto" (the default) with cuda_graphs=True: goes static, records, replays
        cache = hf_ropekv.RopeKVCache(model, budget=args.budget, compress_every=args.compress_every,
                                      protect_prompt=False, cuda_graphs=True)
        run("e2e_ropekv_auto_cuda_graphs_option", cache, args.e2e_tokens)
        result["runs"]["e2e_ropekv_auto_cuda_graphs_option"].update(static=cache.static,
                                                                    static_reason=cache.static_reason)
    if "e2e" in parts:
        run("e2e_ropekv_static_graphed", ropekv(), args.e2e_tokens)
        common.stock_sdpa(model)
        run("e2e_dynamic_eager", DynamicCache(config=model.config), args.e2e_tokens)
    if "compiled" in parts:
        del model.get_compiled_call
        tokens = run("ropekv_static_compiled", ropekv(), args.tokens)
        if tokens is not None:
            result["runs"]["ropekv_static_compiled"].update(
                tokens_equal_eager=None if reference is None else bool(torch.equal(tokens, reference)))
        run("ropekv_static_compiled_again", ropekv(), args.tokens)
    result["wall_s"] = time.perf_counter() - t_start
    (out / "results.json").write_text(json.dumps(result, indent=2, default=str))
    print("done", round(result["wall_s"], 1), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
