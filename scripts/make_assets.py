"""Regenerate the bundled corpus and tokenizer under torchtitan_cp/assets/.

Sources (both public domain texts, shipped by Debian packages):

* Jane Austen's novels from ``r-cran-janeaustenr`` (MIT-licensed packaging; the texts
  are public domain). The novels are R character vectors in a lazy-load database, read
  here with the pure-Python ``rdata`` package (``pip install rdata``). If the package is
  not installed (it pulls in R), the .deb is fetched with ``apt-get download`` and
  unpacked into a temporary folder.
* Chapters of the King James Bible from ``bible-kjv`` / ``bible-kjv-text``
  (``apt-get install bible-kjv``), printed with its ``bible`` command.

Each novel chapter and each Bible chapter becomes one document, so lengths range from a
few dozen tokens (Psalm 117) to several thousand (long novel chapters). About 1 in 20
documents, picked by a hash of its title, goes to the validation split.

Usage::

    .venv/bin/pip install rdata && apt-get install -y bible-kjv
    .venv/bin/python scripts/make_assets.py
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import re
import subprocess
import tempfile
import warnings
import zlib
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "torchtitan_cp" / "assets"

# Three of the six novels keep the corpus near 2 MB; the R object names are the keys.
NOVELS = {
    "prideprejudice": "Pride and Prejudice",
    "sensesensibility": "Sense and Sensibility",
    "persuasion": "Persuasion",
}
# Bible books: mostly short chapters, which gives the corpus its short documents.
KJV_BOOKS = ["Ru", "Ps", "Pr", "Ec", "Song", "La", "Ob", "Jon", "Phm", "Jude"]
JANEAUSTENR_DIR = Path("/usr/lib/R/site-library/janeaustenr")
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
VOCAB_SIZE = 4096
VALIDATION_EVERY = 20
SEED = 1234


def _janeaustenr_dir(workdir: Path) -> Path:
    """Return the installed janeaustenr R package, or unpack its .deb into workdir."""
    if JANEAUSTENR_DIR.is_dir():
        return JANEAUSTENR_DIR
    subprocess.run(["apt-get", "download", "r-cran-janeaustenr"], cwd=workdir, check=True)
    (deb,) = workdir.glob("r-cran-janeaustenr_*.deb")
    subprocess.run(["dpkg-deb", "-x", str(deb), str(workdir / "root")], check=True)
    return workdir / "root" / JANEAUSTENR_DIR.relative_to("/")


def _read_novels(pkg_dir: Path) -> dict[str, list[str]]:
    """Read the novels (one list of text lines each) from R's lazy-load database."""
    import rdata  # only needed to regenerate assets

    base = pkg_dir / "data" / "Rdata"
    with warnings.catch_warnings():
        # rdata warns that the bare serialization stream has no RDS/RDA header.
        warnings.simplefilter("ignore")
        index = rdata.conversion.convert(
            rdata.parser.parse_data(gzip.decompress(base.with_suffix(".rdx").read_bytes()))
        )
        blob = base.with_suffix(".rdb").read_bytes()
        novels = {}
        for name, (offset, length) in index["variables"].items():
            if str(name) not in NOVELS:
                continue
            # Each entry: 4-byte big-endian uncompressed size, then a zlib stream.
            chunk = blob[int(offset) : int(offset) + int(length)]
            value = rdata.conversion.convert(rdata.parser.parse_data(zlib.decompress(chunk[4:])))
            novels[str(name)] = [str(line) for line in value]
    return novels


def _paragraphs(lines: list[str]) -> list[str]:
    """Join hard-wrapped lines into paragraphs; drop the _italics_ markers."""
    paras, cur = [], []
    for line in lines + [""]:
        if line.strip():
            cur.append(line.strip())
        elif cur:
            paras.append(re.sub(r"_([^_]+)_", r"\1", " ".join(cur)))
            cur = []
    return paras


def austen_documents(workdir: Path) -> list[tuple[str, str]]:
    """One (title, text) document per chapter of each selected novel."""
    docs = []
    for name, lines in _read_novels(_janeaustenr_dir(workdir)).items():
        title = NOVELS[name]
        chapters: list[list[str]] = []
        for line in lines:
            if re.match(r"^\s*chapter\s+([ivxlc]+|\d+)\s*$", line, re.IGNORECASE):
                chapters.append([])
            elif chapters:
                chapters[-1].append(line)
        for i, body in enumerate(chapters, 1):
            paras = [p for p in _paragraphs(body) if p.upper() not in ("THE END", "FINIS")]
            head = f"{title}, Chapter {i}"
            docs.append((head, head + "\n\n" + "\n\n".join(paras)))
    return docs


def kjv_documents() -> list[tuple[str, str]]:
    """One (title, text) document per chapter of the selected Bible books."""
    docs = []
    for book in KJV_BOOKS:
        chapter = 1
        while True:
            out = subprocess.run(
                ["bible", "-l0", f"{book}{chapter}:1-999"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            lines = [line.strip() for line in out.splitlines() if line.strip()]
            # Asking past the last chapter prints the last chapter again.
            if not lines or not lines[0].endswith(f" {chapter}"):
                break
            verses = [re.sub(r"^\d+\s+", "", line) for line in lines[1:]]
            docs.append((lines[0], lines[0] + "\n\n" + "\n".join(verses)))
            chapter += 1
    return docs


def split(docs: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """Stable train/validation split by title hash, then a seeded shuffle of each."""
    train, val = [], []
    for title, text in docs:
        h = int(hashlib.sha1(title.encode()).hexdigest(), 16)
        (val if h % VALIDATION_EVERY == 0 else train).append(text)
    rng = random.Random(SEED)
    rng.shuffle(train)
    rng.shuffle(val)
    return train, val


def write_jsonl(path: Path, texts: list[str]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")


def train_tokenizer(texts: list[str], out_dir: Path, vocab_size: int) -> None:
    """Byte-level BPE (GPT-2 style) with BOS/EOS/PAD special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        # torchtitan's text dataset asks for BOS/EOS explicitly per document.
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 1_000_000,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ASSETS)
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        docs = austen_documents(Path(tmp)) + kjv_documents()
    train, val = split(docs)
    corpus = args.out / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    write_jsonl(corpus / "train.jsonl", train)
    write_jsonl(corpus / "validation.jsonl", val)
    train_tokenizer(train, args.out / "tokenizer", args.vocab_size)
    size = sum(len(t.encode()) for t in train + val)
    print(f"{len(train)} train / {len(val)} validation documents, {size / 1e6:.2f} MB of text")


if __name__ == "__main__":
    main()
