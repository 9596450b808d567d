# ruff: noqa - a one-off device script (issue 46), kept with the branch it measures; not benchmark code
"""Issue 46 profile: warm prefill (dynamic vs ropekv), fresh-process first token breakdown, graphed step kernels."""
import collections, cProfile, io, json, os, pstats, subprocess, sys, time
t_start = time.perf_counter()
import torch
sys.path.insert(0, "benchmarks")
import common, speed
MODE = sys.argv[1] if len(sys.argv) > 1 else "main"
dev = torch.device("cuda")
torch.backends.cuda.enable_cudnn_sdp(False)
t_torch = time.perf_counter()
import hf_ropekv
t_lib = time.perf_counter()

def cache_for(name, model):
    if name == "dynamic":
        return None
    return hf_ropekv.RopeKVCache(model, 2048, protect_prompt=False)

def gen(model, cache, prompt, n, **kw):
    return common.run_generate(model, cache, prompt, n, **kw)

if MODE in ("fresh-dynamic", "fresh-ropekv"):
    name = MODE.split("-")[1]
    model = common.build_random_model("qwen3-8b", dtype=torch.bfloat16, device=dev)
    prompt = speed.random_prompt(model, 1, 4096, dev)
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    run = gen(model, cache_for(name, model), prompt, 2)
    pr.disable()
    tot = time.perf_counter() - t0
    print(f"FRESH {name}: import torch {t_torch - t_start:.2f}s hf_ropekv import {t_lib - t_torch:.2f}s; first logits {run['first_logits_ms']:.0f} ms, total(2 tok) {tot*1e3:.0f} ms")
    s = io.StringIO(); st = pstats.Stats(pr, stream=s); st.sort_stats("cumtime"); st.print_stats(45); print(s.getvalue()[-9000:])
    sys.exit(0)

SECTIONS = set(sys.argv[2].split(",")) if len(sys.argv) > 2 else {"ab", "prefill", "census", "host", "fresh"}
model = common.build_random_model("qwen3-8b", dtype=torch.bfloat16, device=dev) if SECTIONS - {"fresh"} else None
prompt = speed.random_prompt(model, 1, 4096, dev) if model is not None else None
for name in ("dynamic", "ropekv", "dynamic", "ropekv") if model is not None else ():
    r = gen(model, cache_for(name, model), prompt, 1)
    print("warm", name, "first logits ms", round(r["first_logits_ms"], 1), flush=True)
from hf_ropekv.model import fused_norms
real_pred = fused_norms.runs_the_kernel
def use_fused(fused):
    fused_norms.runs_the_kernel = real_pred if fused else (lambda t: False)
if "ab" in SECTIONS:
    def step_ms(fused, n=150):
        use_fused(fused)
        r = gen(model, cache_for("ropekv", model), prompt, n)
        use_fused(True)
        return common.percentile(r["steps_ms"][20:], 50)
    step_ms(True, 40); step_ms(False, 40)
    res = {True: [], False: []}
    for rnd in range(2):
        for f in ((True, False) if rnd % 2 else (False, True)):
            res[f].append(step_ms(f))
    print("STEP fused", [round(x, 3) for x in res[True]], "unfused", [round(x, 3) for x in res[False]], flush=True)
    record = {"name": "fused_norms_ab", "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
              "commit": os.environ.get("COMMIT", "?"), "command": "python benchmarks/pending/fused_norms_ab.py main ab,prefill",
              "settings": "Qwen3-8B shape, random bf16 weights, batch 1, 4096-token random prompt, RopeKVCache(model, 2048, protect_prompt=False), greedy generate of 150 tokens, step p50 over steps 20+, fused and eager norms alternated in one process, two rounds",
              "step_p50_ms": {"kernel_norms": res[True], "eager_norms": res[False]}, "profiles": {}}
    for fused in (False, True):
        use_fused(fused)
        clock = speed.ProfilingClock(dev, 40, 8)
        gen(model, cache_for("ropekv", model), prompt, 60, clock=clock)
        print("PROFILE fused" if fused else "PROFILE unfused", json.dumps({k: v for k, v in clock.summary().items() if k != "top_kernels"}), flush=True)
        record["profiles"]["kernel_norms" if fused else "eager_norms"] = clock.summary()
        if os.environ.get("OUT"):
            json.dump(record, open(os.path.join(os.environ["OUT"], "fused_norms_ab.json"), "w"), indent=1)
        if fused and "census" in SECTIONS:
            agg = collections.defaultdict(lambda: [0, 0.0])
            for e in clock.profiler.events():
                if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
                    a = agg[e.name[:90]]; a[0] += 1; a[1] += (e.time_range.end - e.time_range.start)
            for k, (n, t) in sorted(agg.items(), key=lambda x: -x[1][1])[:40]:
                print(f"{n/8:7.1f} /step {t/8/1e3:7.3f} ms  {speed.kernel_class(k):9s} {k}")
    use_fused(True)
if "prefill" in SECTIONS:
    for name in ("dynamic", "ropekv"):
        cache = cache_for(name, model)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            r = gen(model, cache, prompt, 1)
        print(f"=== prefill profile {name}: first logits {r['first_logits_ms']:.1f} ms", flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=60))
if "host" in SECTIONS:
    gen(model, cache_for("ropekv", model), prompt, 20)
    pr = cProfile.Profile(); c = cache_for("ropekv", model)
    t0 = time.perf_counter(); pr.enable(); r = gen(model, c, prompt, 300); pr.disable()
    print("=== host cProfile of a 300-token ropekv generate (graphed)", time.perf_counter() - t0)
    s_ = io.StringIO(); st = pstats.Stats(pr, stream=s_); st.sort_stats("tottime"); st.print_stats(40); print(s_.getvalue()[-9000:], flush=True)
if "fresh" in SECTIONS:
    model = None
    torch.cuda.empty_cache()
    for i, child in enumerate(("fresh-dynamic", "fresh-ropekv", "fresh-dynamic", "fresh-ropekv")):
        out = subprocess.run([sys.executable, __file__, child], capture_output=True, text=True, timeout=200)
        print(out.stdout[-7000:] if i == 3 else "\n".join(l for l in out.stdout.splitlines() if l.startswith("FRESH")), out.stderr[-1500:] if out.returncode else "", flush=True)
