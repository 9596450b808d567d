"""A/B: thread-CPU µs per plain decode step, variants alternated in one process, paired ratios vs DynamicCache."""
import argparse, copy, gc, statistics, sys, time
from ab_imports import hf_ropekv, hf_ropekv_base  # sets the paths first
import torch
from transformers import DynamicCache, LogitsProcessorList
import models
from host_overhead import StepRecorder, run_generate, fill
from hf_ropekv._compat import cache_kwarg
p = argparse.ArgumentParser()
p.add_argument("--variants", nargs="+", default=["dyn", "base", "new"])
p.add_argument("--rounds", type=int, default=10)
p.add_argument("--context", type=int, default=128)
p.add_argument("--budget", type=int, default=64)
p.add_argument("--ce", type=int, default=32)
p.add_argument("--cycles", type=int, default=3)
a = p.parse_args()
torch.set_num_threads(1)
config = models.make_config("tiny-deep")
model = models.build_random_model(config, dtype=torch.float32, device=torch.device("cpu"))
prompt = torch.randint(3, config.vocab_size, (1, a.context), generator=torch.Generator().manual_seed(0))
steps = a.cycles * a.ce - 2; warm = a.ce
dyn = DynamicCache(config=model.config); KW = cache_kwarg(model); fill(model, dyn, prompt, 64, KW)
def make(v):
    gc.collect()
    if v == "dyn": return copy.deepcopy(dyn)
    pkg = {"base": hf_ropekv_base, "new": hf_ropekv, "newrec": hf_ropekv, "baserec": hf_ropekv_base}[v]
    kw = {}
    if v.endswith("rec"):
        pkg = hf_ropekv if v.startswith("new") else hf_ropekv_base
        kw["scorer"] = pkg.scorers.RecencyScorer()
    c = pkg.RopeKVCache(model, budget=a.budget, compress_every=a.ce, protect_prompt=False, **kw)
    fill(model, c, prompt, 64, KW); return c
def once(v):
    c = make(v); r = StepRecorder(c); run_generate(model, c, prompt, steps, KW, r)
    cpu = r.cpu_stamps; return statistics.median([1e6 * (cpu[i + 1] - cpu[i]) for i in r.plain_steps(warm)])
for v in a.variants: once(v)
res = {v: [] for v in a.variants}
for k in range(a.rounds):
    order = a.variants if k % 2 == 0 else a.variants[::-1]
    for v in order: res[v].append(once(v))
for v in a.variants:
    ratios = [x / d for x, d in zip(res[v], res["dyn"])]
    print(f"{v:10} min {min(res[v]):7.0f} med {statistics.median(res[v]):7.0f}  paired ratio med {statistics.median(ratios):.3f} "
          f"min-ratio {min(res[v]) / min(res['dyn']):.3f}  extra µs(med pair) {statistics.median([x - d for x, d in zip(res[v], res['dyn'])]):6.0f}")
