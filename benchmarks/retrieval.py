"""Pass-key and multi-key retrieval haystacks, built here, deterministic from a seed.

A haystack is a chat prompt: an instruction, a document of filler sentences with one or four needles ("The secret
code of Oslo is 4718265.") at depths drawn uniformly, then a question asking for one needle's key. Seeds set
everything: the filler (sentences of ``data/documents.json`` drawn with replacement), how many needles (even seeds
one, odd seeds four), the key kind (numbers, words, UUID-like strings, in turn), labels, keys and depths.
Tune on ``SEEDS["tune"]``, report on ``SEEDS["report"]``: the split is in the seeds, enforced here.

Two settings:

- ``seen``: the question ends the prompt, so it is in the cache when the prompt is compressed;
- ``unseen``: the document is prefilled first, then the question is appended to the same cache as a second turn:
  ``generate`` gets the whole token sequence and feeds the part the cache has not seen. The cache compacts when the
  question arrives, before any of its tokens is stored, so the document is compressed without it. (The document's
  last token used to go in by itself, to compact before anything else arrived; a single-token forward is a
  decoding step, which the default now reads as the input being answered.)
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from common import cache_kwarg
from doc_ppl import load_documents

SEEDS = {"tune": range(64), "report": range(1000, 1064), "held-out": range(2000, 2064)}
KEY_KINDS = ("number", "word", "uuid")
LABELS = ("Oslo", "Lisbon", "Cairo", "Lima", "Quito", "Dakar", "Hanoi", "Perth", "Riga", "Tunis", "Sofia", "Bern",
          "Nairobi", "Manila", "Bogota", "Kyoto")
WORDS = ("lantern", "harbor", "violet", "granite", "meadow", "compass", "falcon", "orchard", "saffron", "glacier",
         "tunnel", "velvet", "anchor", "pepper", "canyon", "marble", "thistle", "beacon", "walnut", "quartz")
INTRO = "Read the document below. Secret codes are hidden in it; you will be asked for one of them."
NEEDLE = "The secret code of {label} is {key}."
QUESTION = "What is the secret code of {label}? Reply with the code only."
_DOC, _QUESTION = "\x00DOCUMENT\x00", "\x00QUESTION\x00"


@dataclass
class Haystack:
    """One prompt: ``head + document`` (the part compressed first when the question is unseen) and ``tail`` (the
    question and the generation prompt); ``key`` is the answer."""

    seed: int
    head: list[int]
    tail: list[int]
    key: str
    kind: str
    needles: int
    depth: float  # of the asked needle, as a fraction of the document

    @property
    def ids(self) -> list[int]:
        return self.head + self.tail


def filler_sentences() -> list[str]:
    """Prose sentences of the committed documents (markup lines dropped), in file order."""
    text = " ".join(line.strip() for d in load_documents() for line in d["text"].splitlines()
                    if line.strip() and not re.match(r"^\W|^\.\.|.*::$", line.strip()))
    sentences = re.split(r"(?<=[.!?])\s+", text)
    return [s for s in sentences if len(s.split()) >= 6 and sum(c.isalpha() for c in s) > 0.7 * len(s)]


def make_key(rng: random.Random, kind: str) -> str:
    if kind == "number":
        return str(rng.randrange(1_000_000, 10_000_000))
    if kind == "word":
        return rng.choice(WORDS)
    return f"{rng.getrandbits(32):08x}-{rng.getrandbits(16):04x}-{rng.getrandbits(16):04x}"


def split_template(tokenizer: Any) -> tuple[str, str]:
    """The chat template around the document: the text before it, and the text between it and the question."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": f"{INTRO}\n\n{_DOC}\n\n{_QUESTION}"}],
                                         add_generation_prompt=True, tokenize=False)
    before, _, rest = text.partition(_DOC)
    between, _, after = rest.partition(_QUESTION)
    return before, between + "{question}" + after


def build(tokenizer: Any, pool_ids: Sequence[list[int]], seed: int, length: int) -> Haystack:
    """The haystack of ``seed``: instruction and document exactly ``length - 32`` tokens, then the question."""
    rng = random.Random(seed)
    needles, kind = (1 if seed % 2 == 0 else 4), KEY_KINDS[(seed // 2) % len(KEY_KINDS)]
    labels = rng.sample(LABELS, needles)
    keys: list[str] = []
    while len(keys) < needles:
        key = make_key(rng, kind)
        keys += [key] if key not in keys else []
    asked = rng.randrange(needles)
    before, question_text = split_template(tokenizer)

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    head = encode(before)
    needle_ids = [encode(" " + NEEDLE.format(label=label, key=key)) for label, key in zip(labels, keys)]
    room = length - 32 - len(head) - sum(map(len, needle_ids))
    if room < 8 * needles:
        raise ValueError(f"a {length}-token haystack leaves no room for the document")
    filler: list[int] = []
    starts: list[int] = []  # where each sentence begins: the places a needle may go
    while len(filler) < room:
        starts.append(len(filler))
        filler += pool_ids[rng.randrange(len(pool_ids))]
    filler = filler[:room]
    starts.append(room)
    depths = [rng.random() for _ in range(needles)]
    places = [min(starts, key=lambda s, d=d: abs(s - d * room)) for d in depths]
    doc: list[int] = []
    done = 0
    for n in sorted(range(needles), key=lambda n: places[n]):
        doc += filler[done:places[n]] + needle_ids[n]
        done = places[n]
    doc += filler[done:]
    tail = encode(question_text.format(question=QUESTION.format(label=labels[asked])))
    return Haystack(seed, head + doc, tail, keys[asked], kind, needles, places[asked] / room)


def found(text: str, key: str) -> bool:
    """Exact match: ``key`` appears in ``text`` as a whole token (not inside a longer number or word)."""
    return re.search(r"(?<![\w-])" + re.escape(key) + r"(?![\w-])", text) is not None


def group_batches(haystacks: list[Haystack], batch: int) -> list[list[Haystack]]:
    """Batches of haystacks whose parts have the same lengths (no padding anywhere), at most ``batch`` each."""
    groups: dict[tuple[int, int], list[Haystack]] = {}
    for h in haystacks:
        groups.setdefault((len(h.head), len(h.tail)), []).append(h)
    return [g[i:i + batch] for g in groups.values() for i in range(0, len(g), batch)]


@torch.no_grad()
def answer(model: torch.nn.Module, batch: list[Haystack], cache: Any, setting: str, max_new_tokens: int,
           stop_ids: list[int]) -> list[list[int]]:
    """The generated token ids of each haystack of ``batch`` with ``cache`` (``None``: the full cache)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    ids = torch.tensor([h.ids for h in batch], device=device)
    cache = DynamicCache(config=model.config) if cache is None else cache
    kwarg = cache_kwarg(model)
    if setting == "unseen":
        model(input_ids=ids[:, : len(batch[0].head)], use_cache=True, logits_to_keep=1, **{kwarg: cache})
    elif setting != "seen":
        raise ValueError(f"setting is seen or unseen, not {setting!r}")
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=stop_ids or None, pad_token_id=(stop_ids or [0])[0],
                         **{kwarg: cache})
    return [row[ids.shape[1]:].tolist() for row in out]


def pool_token_ids(tokenizer: Any) -> list[list[int]]:
    """Each filler sentence tokenized with a leading space, as it stands inside the document."""
    return [list(tokenizer(" " + s, add_special_tokens=False)["input_ids"]) for s in filler_sentences()]

