#!/usr/bin/env python
"""Host cost of the query capture alone: one-token forwards of tiny-deep (36 layers, use_cache=False) with a
QueryCapture (no-op callback) attached or not, alternated 8 forwards at a time; thread-CPU µs per forward.

    PYTHONPATH=<checkout> python capture_cost.py [--base DIR] [--rounds 100]

``--base DIR``: a folder holding an older copy of the package renamed ``hf_ropekv_base`` (``git archive OLD
hf_ropekv``, renamed, with its ``kernels`` link): its capture is measured in the same process.
"""
import argparse, os, statistics, sys, time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", ".."))  # benchmarks/: models.py
p = argparse.ArgumentParser()
p.add_argument("--base", default=None)
p.add_argument("--rounds", type=int, default=100)
a = p.parse_args()
import torch
import models
from hf_ropekv.model.capture import QueryCapture
from hf_ropekv.model.geometry import describe

torch.set_num_threads(1)
model = models.build_random_model(models.make_config("tiny-deep"), dtype=torch.float32, device=torch.device("cpu"))
geometry = describe(model)
captures = {"none": None, "this checkout": QueryCapture(model, geometry, lambda i, q: None)}
if a.base:
    sys.path.insert(0, a.base)
    from hf_ropekv_base.capture import QueryCapture as BaseCapture
    captures["base"] = BaseCapture(model, geometry, lambda i, q: None)
ids = torch.randint(3, 100, (1, 1))


def forwards(n: int = 8) -> float:
    t = time.thread_time()
    with torch.no_grad():
        for _ in range(n):
            model(input_ids=ids, use_cache=False)
    return (time.thread_time() - t) / n * 1e6


times = {name: [] for name in captures}
for r in range(a.rounds):
    for name, capture in (captures.items() if r % 2 else reversed(captures.items())):
        if capture:
            capture.attach()
        times[name].append(forwards())
        if capture:
            capture.detach()
for name in captures:
    if name != "none":
        extra = statistics.median(b - n for n, b in zip(times["none"], times[name]))
        print(f"{name}: +{extra:.0f} µs per forward ({extra / 36:.2f} per layer); forward {statistics.median(times['none']):.0f} µs")
