"""Which numbers to keep keys and values in: the perplexity of documents when every full-attention layer stores its
keys and values through a quantizer of ``hf_ropekv.kernels.quantize`` (one scale per token and KV head), against
unquantized storage. ``int8`` with the key balance is what ``kv_bits=8`` stores; ``fp8`` (e4m3) is the decode
kernel's other format, which the cache does not offer. Teacher-forced, nothing evicted: the NLL of ``--tokens``
tokens fed in ``--chunk``-token forwards after a ``--context``-token prefix, on the committed documents.

    python benchmarks/kv_precision.py --model-cache /tmp/hfcache/qwen25-coder   # Qwen2.5-Coder-1.5B, float32
    python benchmarks/kv_precision.py --dry-run --out /tmp/kv_precision.json     # a tiny random model, seconds
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from transformers import DynamicCache

import common
import doc_ppl
import report

hf_ropekv = common.import_hf_ropekv()
from hf_ropekv.kernels.quantize import channel_balance, dequantize_kv, quantize_kv  # noqa: E402
from hf_ropekv.model.geometry import FULL, describe  # noqa: E402
from hf_ropekv.model.layouts import pair_partner  # noqa: E402

#: name -> (storage dtype or None, keys balanced)
STORAGES: dict[str, tuple[torch.dtype | None, bool]] = {
    "unquantized": (None, False),
    "int8, keys balanced (kv_bits=8)": (torch.int8, True),
    "int8": (torch.int8, False),
    "fp8 e4m3": (torch.float8_e4m3fn, False),
    "fp8 e4m3, keys balanced": (torch.float8_e4m3fn, True),
}


class RoundTripCache(DynamicCache):
    """A full cache whose full-attention layers keep their keys and values as ``dtype`` codes would give them back
    (keys over a balance fixed at the layer's first update, pairs tied as the cache ties them)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None, balanced: bool) -> None:
        super().__init__()
        geometry = describe(model)
        self.full = {i for i, kind in enumerate(geometry.layer_types) if kind == FULL}
        self.partner = pair_partner(geometry.rotary_layout, geometry.rotary_dim // 2, geometry.head_dim)
        self.dtype, self.balanced, self.balance = dtype, balanced, {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.dtype is not None and layer_idx in self.full:
            balance = None
            if self.balanced:
                balance = self.balance.setdefault(layer_idx, channel_balance(key_states, None, self.partner))
            key_states = dequantize_kv(*quantize_kv(key_states, self.dtype, balance), key_states.dtype, balance)
            value_states = dequantize_kv(*quantize_kv(value_states, self.dtype), value_states.dtype)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def document_nll(model: torch.nn.Module, ids: torch.Tensor, cache: DynamicCache, context: int, chunk: int) -> float:
    """Mean NLL of ``ids[context + 1:]``: the first ``context`` tokens go in as one forward, the rest in
    ``chunk``-token forwards (``doc_ppl.chunked_nll``)."""
    with torch.no_grad():
        model(input_ids=ids[:, :context], use_cache=True, **{common.cache_kwarg(model): cache})
        return doc_ppl.chunked_nll(model, ids[0, context:].tolist(), cache, chunk).mean().item()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_run_args(p)
    p.add_argument("--model-path", default=None, help="GGUF file (default: the installed package's)")
    p.add_argument("--model-cache", default=None, help="folder of the dequantized model (written on first use)")
    p.add_argument("--documents", type=int, default=3)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--chunk", type=int, default=128)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    device = torch.device("cpu")
    if args.dry_run:
        model, tokenizer = common.tiny_llama(), common.CharTokenizer()
        args.context, args.tokens, args.chunk = 48, 32, 16
    else:
        model, tokenizer = common.load_real_model("qwen25-coder", model_path=args.model_path,
                                                  model_cache=args.model_cache, device=device, dtype=torch.float32)
    log = common.Clock(args.max_minutes)
    result = common.run_metadata("kv_precision", "kv_precision.py", sys.argv[1:] if argv is None else argv, device,
                                 args.commit)
    result["settings"] = {k: getattr(args, k) for k in ("documents", "context", "tokens", "chunk")}
    docs = doc_ppl.load_documents()[: args.documents]
    nll: dict[str, list[float]] = {name: [] for name in STORAGES}
    for doc in docs:
        ids = torch.tensor([doc_ppl.document_ids(tokenizer, doc["text"], args.context + args.tokens)])
        for name, (dtype, balanced) in STORAGES.items():
            nll[name].append(document_nll(model, ids, RoundTripCache(model, dtype, balanced), args.context, args.chunk))
            log(f"{doc['name']} {name}: NLL {nll[name][-1]:.5f}")
    base = sum(nll["unquantized"]) / len(docs)
    result["rows"] = [{"storage": name, "nll": values, "mean_nll": sum(values) / len(docs),
                       "perplexity_vs_unquantized": math.exp(sum(values) / len(docs) - base)}
                      for name, values in nll.items()]
    out = common.out_path("kv_precision", args.out, device)
    common.write_json(out, result)
    print(report.precision_table(result))  # the table docs/quality.md generates from the result file
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
