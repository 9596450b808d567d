"""CPU probe: does torch.compiler.nested_compile_region on the decoder layer cut generate()'s compile?

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python probe.py plain|wrap eager|inductor LAYERS static|ropekv NEW_TOKENS

Two generate() calls with a fresh cache each; prints the first call's and the second's wall time and the tokens.
``wrap`` marks the decoder layer class's forward as a nested compile region (class-wide: every layer shares the
function, which is what lets dynamo reuse one region for all of them).
"""
import sys
import time

import torch
from transformers import CompileConfig, Qwen3Config, Qwen3ForCausalLM, StaticCache

wrap, backend, layers, cache, new_tokens = sys.argv[1] == "wrap", sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32)
torch.manual_seed(0)
model = Qwen3ForCausalLM(config).eval()
if wrap:
    layer_class = type(model.model.layers[0])
    layer_class.forward = torch.compiler.nested_compile_region(layer_class.forward)
ids = torch.randint(3, 100, (1, 64))
compile_config = CompileConfig(backend=backend, mode=None, fullgraph=True)
compile_config._compile_all_devices = True  # generate() compiles on accelerators only unless told


def run():
    if cache == "ropekv":
        import hf_ropekv

        past = hf_ropekv.RopeKVCache(model, budget=32, static=True, protect_prompt=False, compress_every=8)
    else:
        past = StaticCache(config=model.config, max_cache_len=64 + new_tokens + 4)
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         past_key_values=past, compile_config=compile_config)
    return time.perf_counter() - t0, out


first, out = run()
again, _ = run()
print(sys.argv[1:], f"first {first:.2f}s again {again:.2f}s", out[0, -new_tokens:].tolist())
