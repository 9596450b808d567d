"""Where the step time of RopeKVCache (RecencyScorer: no query capture) goes against DynamicCache: thread-CPU µs
per step inside wrapped functions, steps of the two caches interleaved (step_interleaved.py). NOGC=1, FTZ=1: no
cyclic GC, flush denormals."""
import sys, time, statistics, collections
sys.argv = ["stepab.py", "--variants", "dyn", "newrec", "--steps", "1"]
exec(open(__import__("os").path.join(__import__("os").path.dirname(__import__("os").path.abspath(__file__)), "step_interleaved.py")).read().split("with torch.no_grad():\n    for i in range")[0])
import transformers.cache_utils as CU, transformers.masking_utils as MU
from hf_ropekv import layers as L, attach as A, cache as CA
acc = collections.Counter()
def wrap(owner, name, label):
    orig = getattr(owner, name)
    def w(*args, **kw):
        t = time.thread_time()
        try: return orig(*args, **kw)
        finally: acc[label] += time.thread_time() - t
    setattr(owner, name, w)
wrap(CU.DynamicLayer, "update", "layer.update")
wrap(L.BudgetedLayer, "update", "layer.update")
wrap(MU, "create_causal_mask", "create_causal_mask")
import transformers.models.qwen3.modeling_qwen3 as Q
wrap(Q, "create_causal_mask", "create_causal_mask(q3)")
wrap(A.SharedHooks, "_pre_forward", "model pre-hook")
import transformers.models.qwen3.modeling_qwen3 as Q2
wrap(Q2.Qwen3ForCausalLM, "forward", "causallm.forward")
wrap(A.SharedHooks, "_post_forward", "model post-hook")
wrap(Q.Qwen3Attention, "forward", "attention.forward")
wrap(Q.Qwen3DecoderLayer, "forward", "decoder_layer.forward")
wrap(Q.Qwen3Model, "forward", "model.forward")
import torch.nn as nn
wrap(nn.Linear, "forward", "linear")
wrap(Q.Qwen3RMSNorm, "forward", "rmsnorm")
wrap(nn.Embedding, "forward", "embedding")
wrap(Q.Qwen3RotaryEmbedding, "forward", "rotary_emb")
res = {v: collections.defaultdict(list) for v in a.variants}
import gc, os
if os.environ.get("FTZ"): print("flush denormal", torch.set_flush_denormal(True))
if os.environ.get("NOGC"): gc.disable()
with torch.no_grad():
    for i in range(40):
        for v in a.variants: step(v)
    for i in range(400):
        for v in (a.variants if i % 2 == 0 else a.variants[::-1]):
            acc.clear(); t = time.thread_time(); step(v); total = time.thread_time() - t
            res[v]["total"].append(total)
            for k, x in acc.items(): res[v][k].append(x)
keys = sorted(set(res["dyn"]) | set(res["newrec"]))
for k in keys:
    d = statistics.median(res["dyn"].get(k, [0])) * 1e6; n = statistics.median(res["newrec"].get(k, [0])) * 1e6
    print(f"{k:26} dyn {d:8.0f}  rope {n:8.0f}  diff {n - d:6.0f} µs/step")
