"""Batch and file builders shared by several test modules (in-process; no torchtitan)."""

from __future__ import annotations

import contextlib
import inspect
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch


def fill_positions(bsz: int, seqlen: int, next_length: Callable[[], int]) -> torch.Tensor:
    """int64 ``[bsz, seqlen]`` positions: each row filled with documents of ``next_length()``
    tokens (called once per document, in row order), the last one cut at the row end."""
    pos = torch.empty(bsz, seqlen, dtype=torch.int64)
    for b in range(bsz):
        t = 0
        while t < seqlen:
            n = min(next_length(), seqlen - t)
            pos[b, t : t + n] = torch.arange(n)
            t += n
    return pos


def positions_from_lengths(bsz: int, seqlen: int, lengths: list[int]) -> torch.Tensor:
    """Rows filled with documents of the given lengths (cycled), cut at row ends."""
    it = itertools.count()
    return fill_positions(bsz, seqlen, lambda: lengths[next(it) % len(lengths)])


def random_batch(
    seed: int, bsz: int, seqlen: int, vocab: int, *, one_token_share: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens ``[bsz, seqlen]``, positions of random documents (1 to seqlen // 2 - 1 tokens) and
    next-token labels. With ``one_token_share`` > 0 that share of documents is one token long and
    the others at least two."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (bsz, seqlen), generator=g)

    def next_length() -> int:
        if one_token_share and torch.rand((), generator=g) < one_token_share:
            return 1
        return int(torch.randint(2 if one_token_share else 1, seqlen // 2, (), generator=g))

    positions = fill_positions(bsz, seqlen, next_length)
    return tokens, positions, torch.roll(tokens, -1, dims=1)


def dense_document_block_mask(positions: torch.Tensor, block_size: int = 128):
    """The causal packed-document ``BlockMask`` ``[B, 1, L, L]`` of ``positions [B, L]``, built by
    flex's eager ``create_block_mask`` over all ``L x L`` token pairs: the oracle the PTRR
    balancer (which never builds it) is checked against, and torchtitan's ``cp_shard`` input."""
    from torch.nn.attention.flex_attention import create_block_mask

    from torchtitan_cp.routing import document_mask_mod, row_document_index

    bsz, seqlen = positions.shape
    return create_block_mask(
        document_mask_mod(row_document_index(positions)),
        bsz,
        None,
        seqlen,
        seqlen,
        device=positions.device,
        BLOCK_SIZE=block_size,
    )


def flip(path: Path, offset: int = 100, n: int = 64) -> None:
    """Invert ``n`` bytes of ``path`` from ``offset`` (a corrupted checkpoint shard)."""
    data = bytearray(path.read_bytes())
    for i in range(offset, offset + n):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def row_aligned_corpus(split: Path, interleaved: Path, *, seq_len: int, rows: int) -> None:
    """The same documents (cut from the bundled corpus) in two JSONL files, made so that every
    training row of ``seq_len`` tokens is whole documents (two per row, of varied lengths).
    ``split``: rows A_0..A_{rows-1}, then B_0..B_{rows-1}; ``interleaved``: A_0, B_0, A_1, ...
    Two data-parallel ranks reading ``split`` (each rank a contiguous half) with one row each
    see, at step k, the rows one rank reading ``interleaved`` with two rows sees: the same
    global batch, each rank different data."""
    import json

    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    assets = Path(__file__).resolve().parents[1] / "torchtitan_cp" / "assets"
    tok = HuggingFaceTokenizer(tokenizer_path=str(assets / "tokenizer"))
    corpus = (assets / "corpus" / "train.jsonl").read_text().splitlines()
    texts = (json.loads(line)["text"] for line in corpus)

    def exact(n_inputs: int) -> str:
        """A prefix of the next corpus text that the loader turns into ``n_inputs`` inputs
        (its tokens with BOS and EOS, less one)."""
        for text in texts:
            ids = tok.encode(text[: 8 * n_inputs], add_bos=False, add_eos=False)
            for cut in range(n_inputs - 1, min(len(ids), n_inputs + 8)):
                piece = tok.decode(ids[:cut])
                if len(tok.encode(piece, add_bos=True, add_eos=True)) - 1 == n_inputs:
                    return piece
        raise AssertionError(f"no corpus text gives {n_inputs} inputs")

    def row(i: int) -> list[str]:
        first = 40 + (53 * i) % (seq_len - 80)
        return [exact(first), exact(seq_len - first)]

    a = [row(i) for i in range(rows)]
    b = [row(rows + i) for i in range(rows)]

    def write(path: Path, docs: list[list[str]]) -> None:
        lines = [json.dumps({"text": t}) for pair in docs for t in pair]
        path.write_text("\n".join(lines) + "\n")

    write(split, [*a, *b])
    write(interleaved, [r for pair in zip(a, b, strict=True) for r in pair])


@contextlib.contextmanager
def unwrapped(module: ModuleType, names: tuple[str, ...]) -> Iterator[None]:
    """``module``'s functions ``names`` replaced by what their decorators wrap, restored on exit.

    transformers' modeling modules route their recurrences and convs through decorators that
    pick fla-core's Triton kernels when fla is installed (it is, for the recipe), which need a
    GPU; unwrapped, they are transformers' own PyTorch implementations."""
    saved = {n: getattr(module, n) for n in names}
    try:
        for name, fn in saved.items():
            setattr(module, name, inspect.unwrap(fn))
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
