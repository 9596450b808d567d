"""``import hf_ropekv`` costs about what ``import torch, transformers`` costs: it must not pull in transformers'
model-loading code (``PreTrainedModel`` lives in ``transformers.modeling_utils``, which imports the fp8 / deepgemm
integrations, ``torch.distributed.tensor`` and more: seconds of start-up for a command-line tool or a worker).

Checked by what a fresh interpreter has imported, not by timing (timings on a shared machine are noise).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import SUBPROCESS_CWD


#: Modules that only loading or building a model needs; each costs a second or more to import.
MODEL_LOADING_MODULES = (
    "transformers.modeling_utils",
    "transformers.conversion_mapping",
    "transformers.integrations.finegrained_fp8",
)


def _imported_after(statement: str, names: tuple[str, ...]) -> dict[str, bool]:
    """Which of ``names`` a fresh interpreter has in ``sys.modules`` after ``statement``."""
    code = f"import json, sys\n{statement}\nprint(json.dumps({{n: n in sys.modules for n in {list(names)!r}}}))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=SUBPROCESS_CWD, capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_probe_sees_model_loading_code_when_it_is_imported() -> None:
    """The check below can fail: importing PreTrainedModel shows every one of these modules as loaded."""
    assert all(_imported_after("from transformers import PreTrainedModel", MODEL_LOADING_MODULES).values())


def test_import_hf_ropekv_does_not_load_model_loading_code() -> None:
    imported = _imported_after("import hf_ropekv", MODEL_LOADING_MODULES + ("hf_ropekv",))
    assert imported.pop("hf_ropekv")
    assert [name for name, loaded in imported.items() if loaded] == []


def test_import_hf_ropekv_does_not_load_the_compiler() -> None:
    imported = _imported_after("import hf_ropekv", ("torch._dynamo", "sympy", "torch.distributed.tensor"))
    assert [name for name, loaded in imported.items() if loaded] == []


_GRAPHED_GENERATE = """
import warnings
import torch
from transformers import CompileConfig
from conftest import padded_batch, tiny_model
from hf_ropekv import RopeKVCache
from hf_ropekv._compat import cache_kwarg
model = tiny_model("qwen3")
ids, mask = padded_batch(model.config.vocab_size, lengths=(9,))
config = CompileConfig()  # inductor, as generate compiles by default
config._compile_all_devices = True  # generate hands the decode steps to get_compiled_call on the CPU too
cache = RopeKVCache(model, budget=16, compress_every=4, static=True, cuda_graphs={graphs})
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the graphed executor declines the CPU, and the steps run eagerly
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                   compile_config=config, **{{cache_kwarg(model): cache}})
"""


@pytest.mark.parametrize("graphs", [True, False])
def test_a_graphed_cache_never_builds_generates_compiled_forward(graphs: bool) -> None:
    """generate asks for its compiled forward before the prefill; ``torch.compile()`` itself imports inductor's
    compile_fx (1.35 s on this machine even with the model's modules loaded), in the time to the first token. A
    cache whose steps replay CUDA graphs never calls it, so it is built at the first step that does: never, with
    graphs. Without them (``cuda_graphs=False``) the same generate does build it: the check can fail."""
    imported = _imported_after(_GRAPHED_GENERATE.format(graphs=graphs), ("torch._inductor.compile_fx",))
    assert imported["torch._inductor.compile_fx"] is (not graphs)
