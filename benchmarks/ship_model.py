"""Carry a GGUF model (Qwen2.5-Coder-1.5B-Instruct by default) to the GPU machine in pieces, and put it back there.

A device call carries at most 64 MiB (the work tree included) and a machine keeps its files only while it stays warm,
so the 1.1 GB file goes in 19 pieces of at most 57 MiB, one a call, each appended to one file there. Here, once (the
pieces go to the git-ignored ``.models/qwen_parts/``)::

    python benchmarks/ship_model.py split          # prints the piece count and the sha256 of the whole

On the GPU machine, every call (carry ``.models/qwen_parts/manifest.json`` and that call's piece)::

    python3 benchmarks/ship_model.py append .models/qwen_parts --target /tmp/qwen.gguf

``append`` adds the pieces that come next. A target shorter than the first piece found expects (a cold machine, or
a skipped piece) prints ``GAP`` and the missing pieces. Exit status: 0 complete and verified (so ``append ... &&
python3 benchmarks/quality.py ...`` runs only on a whole model), 2 progressing (``NEXT piece_NN``), 3 gap or cold
machine, 4 checksum mismatch.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PIECE_BYTES = 57 * 2**20  # a call carries 64 MiB; the tracked tree is about 1.5 MB
MANIFEST = "manifest.json"
EXIT_PROGRESS, EXIT_GAP, EXIT_CHECKSUM = 2, 3, 4


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(16 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _qwen_gguf() -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    return importlib.import_module("common").find_model_file("qwen25-coder")


def split(source: Path, out: Path, piece_bytes: int = PIECE_BYTES) -> dict:
    """Cut ``source`` into ``out/piece_NN`` of at most ``piece_bytes`` and write ``out/manifest.json``."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("piece_*"):
        old.unlink()
    whole = hashlib.sha256()
    pieces = []
    with source.open("rb") as f:
        while block := f.read(piece_bytes):
            whole.update(block)
            name = f"piece_{len(pieces):02d}"
            (out / name).write_bytes(block)
            offset = sum(p["bytes"] for p in pieces)
            pieces.append({"name": name, "offset": offset, "bytes": len(block),
                           "sha256": hashlib.sha256(block).hexdigest()})
    manifest = {"source": source.name, "bytes": source.stat().st_size, "sha256": whole.hexdigest(),
                "piece_bytes": piece_bytes, "pieces": pieces}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def _missing(manifest: dict, have: int) -> list[str]:
    return [p["name"] for p in manifest["pieces"] if p["offset"] + p["bytes"] > have]


def append(folder: Path, target: Path) -> int:
    """Append the pieces in ``folder`` that continue ``target``; return the exit status (see module doc)."""
    manifest = json.loads((folder / MANIFEST).read_text())
    have = target.stat().st_size if target.exists() else 0
    if have > manifest["bytes"]:
        print(f"GAP: {target} has {have} bytes, more than the model's {manifest['bytes']}: delete it, start over")
        return EXIT_GAP
    for piece in manifest["pieces"]:
        path = folder / piece["name"]
        end = piece["offset"] + piece["bytes"]
        if end <= have or not path.is_file():
            continue  # already in the target, or not carried in this call
        if piece["offset"] != have:
            missing = [p["name"] for p in manifest["pieces"] if have < p["offset"] + p["bytes"] <= piece["offset"]]
            cold = " (cold machine: the target is gone, start again from piece 00)" if have == 0 else ""
            print(f"GAP: got {piece['name']} but {target} has {have} bytes; missing first: {', '.join(missing)}{cold}")
            return EXIT_GAP
        if path.stat().st_size != piece["bytes"]:
            print(f"GAP: {path} has {path.stat().st_size} bytes, the manifest says {piece['bytes']}: resend it")
            return EXIT_GAP
        with target.open("ab") as out, path.open("rb") as src:
            while block := src.read(16 << 20):
                out.write(block)
        have = end
        print(f"appended {piece['name']}: {target} now {have} bytes")
    return status(manifest, target)


def status(manifest: dict, target: Path) -> int:
    have = target.stat().st_size if target.exists() else 0
    missing = _missing(manifest, have)
    if missing:
        cold = " (cold machine, or nothing sent yet)" if have == 0 else ""
        print(f"NEXT {missing[0]}: {len(missing)} of {len(manifest['pieces'])} pieces to go; "
              f"{target} has {have} of {manifest['bytes']} bytes{cold}")
        return EXIT_PROGRESS
    digest = _sha256(target)
    if digest != manifest["sha256"]:
        print(f"CHECKSUM MISMATCH: {target} sha256 {digest}, expected {manifest['sha256']}: delete it, resend all")
        return EXIT_CHECKSUM
    print(f"COMPLETE {target}: {have} bytes, sha256 {digest} ok")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="cut the assembled Qwen GGUF into pieces (here)")
    s.add_argument("--source", default=None, help="GGUF file (default: the offline Qwen2.5-Coder, assembled)")
    s.add_argument("--out", default=str(REPO / ".models" / "qwen_parts"))
    s.add_argument("--piece-mib", type=int, default=PIECE_BYTES >> 20,
                   help="piece size; the work tree travels with each piece, and a call carries 64 MiB in all")
    for name in ("append", "status"):
        a = sub.add_parser(name, help="append the next pieces (GPU machine)" if name == "append" else
                           "report what the target holds")
        a.add_argument("folder", help="folder with manifest.json and some pieces")
        a.add_argument("--target", default="/tmp/qwen.gguf")
    args = p.parse_args(argv)
    if args.cmd == "split":
        source = Path(args.source) if args.source else _qwen_gguf()
        manifest = split(source, Path(args.out), args.piece_mib * 2**20)
        print(f"{len(manifest['pieces'])} pieces of at most {args.piece_mib} MiB in {args.out}; "
              f"{manifest['bytes']} bytes, sha256 {manifest['sha256']}")
        return 0
    folder, target = Path(args.folder), Path(args.target)
    if args.cmd == "append":
        return append(folder, target)
    return status(json.loads((folder / MANIFEST).read_text()), target)


if __name__ == "__main__":
    sys.exit(main())
