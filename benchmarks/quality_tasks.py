"""Documents, planted passkeys and calibration texts for ``benchmarks/perplexity.py``.

Everything is offline and deterministic:

- evaluation documents: long prose files of Debian's ``linux-doc-6.1`` (``examples/offline_assets.py``: ``linux_doc_texts``);
- in-domain-ish calibration: the Python 3.11 documentation (``python_doc_texts``: English prose about
  software, disjoint from the kernel documentation);
- cross-domain calibration: the Python standard library's source code (the running interpreter's
  ``.py`` files), i.e. "calibrated on code, evaluated on prose".

One evaluation :class:`Sample` is one token stream::

    header | kernel documentation ... NEEDLE ... kernel documentation | question | answer

The needle ("The secret passkey is 73918. Remember it: ...") sits at a paragraph boundary near a
given depth of the document. The perplexity / agreement metrics are taken over the document's own
tokens (the needle excluded); the retrieval metrics over the answer tokens, teacher-forced.
"""

from __future__ import annotations

import random
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

HEADER = (
    "The following is an excerpt of the Linux kernel documentation. A secret passkey is hidden "
    "somewhere in it. Read the text and remember the passkey.\n\n"
)
NEEDLE = "The secret passkey is {key}. Remember it: the secret passkey is {key}."
QUESTION = "\n\nQuestion: What is the secret passkey mentioned in the text above?\nAnswer: The secret passkey is"
ANSWER = " {key}."

#: Fraction of letters and whitespace a file needs to count as prose (drops register maps, tables of numbers).
PROSE_MIN_LETTERS = 0.80
#: linux-doc folders holding translations (Italian, Chinese, Japanese, Korean, Spanish): not English.
NON_ENGLISH = ("translations/",)


@dataclass
class Sample:
    """One evaluation stream.

    Attributes:
        name: the source document (and depth).
        ids: token ids of the whole stream (header, document with needle, question, answer).
        doc_span: ``(start, end)`` token indices of the document part (needle included).
        needle_span: ``(start, end)`` token indices of the needle sentence.
        answer_span: ``(start, end)`` token indices of the answer (the passkey digits and the final dot).
        passkey: the planted number, as text.
        depth: where the needle was planted, as a fraction of the document.
    """

    name: str
    ids: list[int]
    doc_span: tuple[int, int]
    needle_span: tuple[int, int]
    answer_span: tuple[int, int]
    passkey: str
    depth: float
    meta: dict[str, Any] = field(default_factory=dict)

    def eval_targets(self, first: int) -> list[int]:
        """Target token indices scored by the perplexity metrics: document tokens from ``first`` on, needle excluded."""
        start, end = self.doc_span
        n0, n1 = self.needle_span
        return [t for t in range(max(start, first), end) if not n0 <= t < n1]


def _letters_fraction(text: str) -> float:
    if not text:
        return 0.0
    return sum(c.isalpha() or c.isspace() for c in text) / len(text)


def prose_documents(min_chars: int, count: int | None = None) -> list[tuple[str, str]]:
    """``(name, text)`` of English linux-doc files with at least ``min_chars`` characters that read as prose.

    ``count`` files are picked evenly spaced over the sorted list (different subsystems), deterministically.
    """
    from common import offline_assets

    docs = [
        (n, t)
        for n, t in offline_assets().linux_doc_texts(min_chars=min_chars)
        if not n.startswith(NON_ENGLISH) and _letters_fraction(t) >= PROSE_MIN_LETTERS
    ]
    if count is None or count >= len(docs):
        return docs
    step = len(docs) / count
    return [docs[int(i * step + step / 2)] for i in range(count)]


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _paragraph_cut(text: str, at: int) -> int:
    """Character offset of the paragraph (else line) boundary nearest ``at``."""
    best = None
    for sep in ("\n\n", "\n"):
        left, right = text.rfind(sep, 0, at), text.find(sep, at)
        candidates = [p + len(sep) for p in (left, right) if p >= 0]
        if candidates:
            best = min(candidates, key=lambda p: abs(p - at))
            if abs(best - at) < 2000:
                return best
    return best if best is not None else at


def build_sample(
    tokenizer: Any, name: str, text: str, doc_tokens: int, depth: float, passkey: str
) -> Sample | None:
    """A stream of exactly ``doc_tokens`` tokens (header + document + needle + question + answer).

    Returns ``None`` when ``text`` is too short.
    """
    header = _encode(tokenizer, HEADER)
    needle = _encode(tokenizer, "\n\n" + NEEDLE.format(key=passkey) + "\n\n")
    question = _encode(tokenizer, QUESTION)
    # The answer is tokenized together with the question, as the model would see the completed text.
    qa = _encode(tokenizer, QUESTION + ANSWER.format(key=passkey))
    if qa[: len(question)] != question:
        raise ValueError("question and answer do not tokenize separably; change QUESTION/ANSWER")
    answer = qa[len(question):]
    body_len = doc_tokens - len(header) - len(needle) - len(qa)
    if body_len <= 0:
        raise ValueError(f"doc_tokens={doc_tokens} leaves no room for the document")
    body = _encode(tokenizer, text)
    if len(body) < body_len:
        return None
    body_text = tokenizer.decode(body[:body_len])
    cut = _paragraph_cut(body_text, int(depth * len(body_text)))
    before, after = _encode(tokenizer, body_text[:cut]), _encode(tokenizer, body_text[cut:])
    # Re-tokenizing the two halves can change the count by a token or two: trim the tail to fit exactly.
    after = after[: max(0, body_len - len(before))]
    ids = header + before + needle + after + question + answer
    doc_start = len(header)
    needle_start = doc_start + len(before)
    doc_end = needle_start + len(needle) + len(after)
    answer_start = len(ids) - len(answer)
    return Sample(
        name=f"{name}@{depth:.0%}",
        ids=ids,
        doc_span=(doc_start, doc_end),
        needle_span=(needle_start, needle_start + len(needle)),
        answer_span=(answer_start, len(ids)),
        passkey=passkey,
        depth=depth,
        meta={"document": name, "needle_token_depth": (needle_start - doc_start) / max(1, doc_end - doc_start)},
    )


def passkey_samples(
    tokenizer: Any,
    num_docs: int,
    doc_tokens: int,
    depths: Sequence[float] = (0.1, 0.5, 0.9),
    seed: int = 0,
    all_depths: bool = False,
) -> list[Sample]:
    """``num_docs`` different linux-doc documents, each a stream of ``doc_tokens`` tokens with a passkey.

    Document ``i`` gets depth ``depths[i % len(depths)]`` (or, with ``all_depths``, one sample per depth).
    Passkeys are random 5-digit numbers from ``seed``.
    """
    rng = random.Random(seed)
    # ~3.5 characters per token for this text; ask for a margin so most candidates are long enough.
    candidates = prose_documents(min_chars=int(doc_tokens * 4.5))
    if not candidates:
        raise ValueError(f"no linux-doc file is long enough for {doc_tokens}-token documents")
    step = len(candidates) / max(num_docs, 1)
    order = [int(i * step + step / 2) for i in range(num_docs)]
    order += [i for i in range(len(candidates)) if i not in order]  # spares, for files that come out short
    samples: list[Sample] = []
    docs_used = 0
    for idx in order:
        if docs_used == num_docs:
            break
        name, text = candidates[idx]
        depth_list = list(depths) if all_depths else [depths[docs_used % len(depths)]]
        made = []
        for depth in depth_list:
            sample = build_sample(tokenizer, name, text, doc_tokens, depth, str(rng.randrange(10_000, 100_000)))
            if sample is None:
                break
            made.append(sample)
        if len(made) == len(depth_list):
            samples += made
            docs_used += 1
    if docs_used < num_docs:
        raise ValueError(f"only {docs_used} linux-doc files hold {doc_tokens} tokens of prose; asked for {num_docs}")
    return samples


# --------------------------------------------------------------------------- calibration texts


def python_doc_calibration_texts(seed: int = 0) -> list[str]:
    """Pages of the Python documentation in a seeded random order (so a token cap samples all sections)."""
    from common import offline_assets

    texts = [t for _, t in offline_assets().python_doc_texts(min_chars=2000)]
    random.Random(seed).shuffle(texts)
    return texts


def stdlib_code_texts(seed: int = 0, min_chars: int = 2000) -> list[str]:
    """Source files of the running interpreter's standard library (tests and site-packages excluded), shuffled."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    texts = []
    for path in files:
        try:
            text = path.read_text("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) >= min_chars:
            texts.append(text)
    random.Random(seed).shuffle(texts)
    return texts


CALIBRATION_SOURCES = {
    "pydoc": ("Python 3.11 documentation (prose, disjoint from linux-doc)", python_doc_calibration_texts),
    "pycode": ("Python 3.11 standard library source code (cross-domain: code)", stdlib_code_texts),
}
