"""First GPU check of the reworked library (not committed): decode kernel in the default cache, int8, exactness."""
import json, os, sys, time, statistics
import torch
from transformers import AutoModelForCausalLM, AutoConfig, DynamicCache, LogitsProcessor, LogitsProcessorList
import hf_ropekv
from hf_ropekv import RopeKVCache

torch.backends.cuda.enable_cudnn_sdp(False)
OUT = os.environ.get("OUT", "/tmp")
results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}


class Clock(LogitsProcessor):
    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def qwen3_8b():
    cfg = AutoConfig.for_model("qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                               max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def run(model, cache, ids, new):
    clock = Clock()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                             past_key_values=cache, logits_processor=LogitsProcessorList([clock]), pad_token_id=0)
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    steps = [b - a for a, b in zip(clock.times[1:], clock.times[2:])]
    return out, dict(total_s=round(total, 3), ttft_s=round(clock.times[0] - t0, 3),
                     first_step_s=round(clock.times[1] - clock.times[0], 3),
                     p50_ms=round(1e3 * statistics.median(steps), 2), mean_ms=round(1e3 * statistics.mean(steps), 2))


t = time.time()
model = qwen3_8b()
results["build_s"] = round(time.time() - t, 1)
gen = torch.Generator(device="cuda").manual_seed(1)
for batch, prompt in ((1, 4096), (1, 32768), (32, 4096)):
    ids = torch.randint(100, 150000, (batch, prompt), device="cuda", generator=gen)
    row = {}
    new = 256 if batch == 1 else 128
    variants = {
        "dynamic": lambda: DynamicCache(config=model.config),
        "ropekv": lambda: RopeKVCache(model, budget=2048, protect_prompt=False),
        "ropekv_int8": lambda: RopeKVCache(model, budget=2048, protect_prompt=False, kv_bits=8),
    }
    for rnd in range(2):
        for name, make in variants.items():
            if name == "dynamic" and prompt > 8192 and rnd == 1:
                continue
            cache = make()
            out, stats = run(model, cache, ids, new)
            if isinstance(cache, RopeKVCache):
                stats.update(static=cache.static, bytes=cache.bytes_held, compactions=cache.num_compactions)
            row[f"{name}_r{rnd}"] = stats
            print(batch, prompt, name, rnd, stats, flush=True)
            del cache, out
            torch.cuda.empty_cache()
    results[f"{batch}x{prompt}"] = row

# exactness: nothing evicted, the default (static, graphed) cache against DynamicCache
ids = torch.randint(100, 150000, (4, 512), device="cuda", generator=gen)
ref, _ = run(model, DynamicCache(config=model.config), ids, 64)
ours, _ = run(model, RopeKVCache(model, budget=4096), ids, 64)
results["exact_nothing_evicted"] = bool(torch.equal(ref, ours))
ours_none, _ = run(model, RopeKVCache(model, budget=None), ids, 64)
results["exact_budget_none"] = bool(torch.equal(ref, ours_none))
# with eviction: graphed steps equal the eager static steps (kernel in both)
c1 = RopeKVCache(model, budget=256, protect_prompt=False, compress_every=32)
a, _ = run(model, c1, ids, 96)
c2 = RopeKVCache(model, budget=256, protect_prompt=False, compress_every=32, static=True)
with torch.no_grad():
    b = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=96, do_sample=False,
                       past_key_values=c2, pad_token_id=0, disable_compile=True)
results["graphed_equals_eager_with_eviction"] = bool(torch.equal(a, b))
results["graphed_vs_eager_agree"] = float((a == b).float().mean())
print(results, flush=True)
json.dump(results, open(os.path.join(OUT, "gpu_check.json"), "w"), indent=1)
