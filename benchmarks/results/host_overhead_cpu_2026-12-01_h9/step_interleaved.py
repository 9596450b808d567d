"""Decode steps of several caches interleaved one step at a time (thread CPU µs per step): drift hits all alike.

Variants: dyn (DynamicCache), new (RopeKVCache of this checkout), base (of BASE/hf_ropekv_base); suffix rec:
RecencyScorer (no query capture); suffix contig: attention gets contiguous copies of the arena's keys/values."""
import argparse, copy, gc, statistics, sys, time
from ab_imports import hf_ropekv, hf_ropekv_base  # sets the paths first
import torch
from transformers import DynamicCache
import models
from host_overhead import fill
from hf_ropekv._compat import cache_kwarg
p = argparse.ArgumentParser()
p.add_argument("--variants", nargs="+", default=["dyn", "base", "new"])
p.add_argument("--steps", type=int, default=1500)
a = p.parse_args()
torch.set_num_threads(1)
config = models.make_config("tiny-deep")
config.max_position_embeddings = 8192
model = models.build_random_model(config, dtype=torch.float32, device=torch.device("cpu"))
KW = cache_kwarg(model)
prompt = torch.randint(3, config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
def make(v):
    if v == "dyn": c = DynamicCache(config=model.config)
    else:
        pkg = hf_ropekv if v.startswith("new") else hf_ropekv_base
        extra = {"scorer": pkg.scorers.RecencyScorer()} if "rec" in v else {}
        c = pkg.RopeKVCache(model, budget=64, compress_every=32, protect_prompt=False, **extra)
    fill(model, c, prompt, 64, KW)
    if v.endswith("contig"):
        for layer in c._full_layers:
            st = layer.storage
            def app(k, vv, first_position, st=st, orig=type(st).append):
                keys, values = orig(st, k, vv, first_position)
                return keys.contiguous(), values.contiguous()
            st.append = app
    return c
# All caches live at once: each one's hooks act only on its own forwards (idle otherwise), as with several caches.
state = {}
for v in a.variants:
    state[v] = dict(cache=make(v), mask=torch.ones(1, 127, dtype=torch.long), tok=prompt[:, -1:], times=[])
def step(v):
    s = state[v]; c = s["cache"]
    seen = c.get_seq_length()
    s["mask"] = torch.ones(1, seen + 1, dtype=torch.long)
    pos = torch.tensor([[seen]])
    before = getattr(c, "num_compactions", 0)
    t = time.thread_time()
    out = model(input_ids=s["tok"], attention_mask=s["mask"], position_ids=pos, use_cache=True, **{KW: c})
    tok = out.logits[:, -1:].argmax(-1)
    dt = time.thread_time() - t
    s["tok"] = tok
    if v == "dyn" and seen >= 160:
        c.crop(-(seen + 1 - 128))  # keep DynamicCache near the RopeKVCaches' lengths
    if getattr(c, "num_compactions", 0) == before: s["times"].append(dt * 1e6)
with torch.no_grad():
    for i in range(a.steps):
        for v in (a.variants if i % 2 == 0 else a.variants[::-1]):
            step(v)
d = statistics.median(state["dyn"]["times"][100:]) if "dyn" in state else None
for v in a.variants:
    t = state[v]["times"][100:]
    m = statistics.median(t)
    print(f"{v:8} median {m:7.0f} µs  mean {statistics.mean(t):7.0f}  n={len(t)}" + (f"  ratio {m / d:.3f}  extra {m - d:5.0f} µs" if d else ""))
