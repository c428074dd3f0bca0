"""Tests for the bundled corpus/tokenizer and the packed dataloaders (torchtitan_cp.data.loader)."""

from __future__ import annotations

import json
import pickle
from dataclasses import replace

import pytest
import torch
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.components.validate import Validator

from torchtitan_cp.data.loader import (
    BUNDLED_TOKENIZER_PATH,
    BUNDLED_TRAIN_PATH,
    BUNDLED_VALIDATION_PATH,
    HOST_METADATA_KEY,
    DataError,
    HostMetadata,
    PackedTextDataLoader,
    PackedValidationDataLoader,
    collate_with_host_metadata,
    pop_host_metadata,
)

SEQ_LEN = 128
BATCH = 4


@pytest.fixture(scope="module")
def tokenizer() -> HuggingFaceTokenizer:
    return HuggingFaceTokenizer.Config().build(tokenizer_path=BUNDLED_TOKENIZER_PATH)


def build(tokenizer, config=None, *, dp_rank=0, dp_world_size=1, seq_len=SEQ_LEN, batch=BATCH):
    config = config if config is not None else PackedTextDataLoader.Config()
    return config.build(
        dp_world_size=dp_world_size,
        dp_rank=dp_rank,
        tokenizer=tokenizer,
        seq_len=seq_len,
        local_batch_size=batch,
    )


def read_texts(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def expected_rows(tokenizer, texts, rows, seq_len):
    """torchtitan's packing, restated: shift within each document, then cut into rows."""
    inputs, labels, positions = [], [], []
    for text in texts:
        ids = tokenizer.encode(text, add_bos=True, add_eos=True)
        inputs += ids[:-1]
        labels += ids[1:]
        positions += range(len(ids) - 1)
        if len(inputs) >= rows * seq_len:
            break
    n = rows * seq_len
    pos = torch.tensor(positions[:n]).view(rows, seq_len).clone()
    for row in pos:  # a row starting mid-document counts from 0 up to the next document
        offset = int(row[0])
        for j in range(seq_len):
            if j > 0 and row[j] == 0:
                break
            row[j] -= offset
    return (
        torch.tensor(inputs[:n]).view(rows, seq_len),
        torch.tensor(labels[:n]).view(rows, seq_len),
        pos,
    )


def test_corpus_is_real_text_with_varied_lengths(tokenizer):
    train, val = read_texts(BUNDLED_TRAIN_PATH), read_texts(BUNDLED_VALIDATION_PATH)
    assert len(train) > 300 and len(val) > 10
    assert not set(train) & set(val)
    lengths = [len(e.ids) for e in tokenizer.tokenizer.encode_batch(train)]
    assert min(lengths) < 100 and max(lengths) > 5000


def test_bundled_tokenizer_loads_and_round_trips(tokenizer):
    assert 2048 <= tokenizer.get_vocab_size() <= 4096
    assert tokenizer.bos_id is not None and tokenizer.eos_id is not None
    assert tokenizer.bos_id != tokenizer.eos_id
    text = "It is a truth universally acknowledged, that a single man\nwants a wife. 1811!"
    ids = tokenizer.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    assert tokenizer.encode(text) == ids[1:-1]  # not added unless asked
    assert tokenizer.decode(ids[1:-1]) == text
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|bos|>" + text + "<|eos|>"
    # Byte-level: any Unicode round-trips.
    assert tokenizer.decode(tokenizer.encode("naïve café ✓")) == "naïve café ✓"


def test_batch_keys_shapes_and_dtypes(tokenizer):
    input_dict, labels = next(iter(build(tokenizer)))
    assert set(input_dict) == {"input", "positions", HOST_METADATA_KEY}
    for t in (input_dict["input"], input_dict["positions"], labels):
        assert t.shape == (BATCH, SEQ_LEN) and t.dtype == torch.int64
    assert isinstance(input_dict[HOST_METADATA_KEY], HostMetadata)


def test_packing_matches_torchtitan_semantics(tokenizer):
    input_dict, labels = next(iter(build(tokenizer)))
    want_in, want_lab, want_pos = expected_rows(
        tokenizer, read_texts(BUNDLED_TRAIN_PATH), BATCH, SEQ_LEN
    )
    assert torch.equal(input_dict["input"], want_in)
    assert torch.equal(labels, want_lab)
    assert torch.equal(input_dict["positions"], want_pos)


def test_positions_reset_and_labels_shift_within_documents(tokenizer):
    # Short rows so several batches cross document boundaries and row edges.
    loader = iter(build(tokenizer, seq_len=64, batch=8))
    for _ in range(5):
        input_dict, labels = next(loader)
        inp, pos = input_dict["input"], input_dict["positions"]
        starts = pos == 0
        # torchtitan restarts positions at 0 on every row, even mid-document.
        assert (pos[:, 0] == 0).all()
        # Inside a row, position 0 exactly marks BOS, i.e. a document start.
        assert torch.equal(starts[:, 1:], inp[:, 1:] == tokenizer.bos_id)
        same_doc = ~starts[:, 1:]
        assert torch.equal(pos[:, 1:][same_doc], pos[:, :-1][same_doc] + 1)
        # Label = next input inside a document, EOS right before the next document.
        assert torch.equal(labels[:, :-1][same_doc], inp[:, 1:][same_doc])
        assert (labels[:, :-1][starts[:, 1:]] == tokenizer.eos_id).all()
        # Rows are consecutive slices of one stream: a row's last label feeds the next row.
        cont = inp[1:, 0] != tokenizer.bos_id
        assert cont.any()
        assert torch.equal(labels[:-1, -1][cont], inp[1:, 0][cont])
        assert (labels[:-1, -1][~cont] == tokenizer.eos_id).all()


def test_host_metadata_survives_device_moves(tokenizer):
    input_dict, _ = next(iter(build(tokenizer)))
    meta = input_dict[HOST_METADATA_KEY]
    assert torch.equal(meta.positions, input_dict["positions"])
    assert meta.positions.device.type == "cpu"
    assert meta.positions.data_ptr() != input_dict["positions"].data_ptr()
    assert meta.to("meta") is meta
    assert meta.to(torch.device("meta"), non_blocking=True) is meta
    # The trainer moves only tensors; the validator calls .to() on every value.
    trainer_moved = {
        k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in input_dict.items()
    }
    validator_moved = {k: v.to("meta") for k, v in input_dict.items()}
    for moved in (trainer_moved, validator_moved):
        assert moved["positions"].device.type == "meta"
        assert moved[HOST_METADATA_KEY] is meta
        assert pop_host_metadata(moved) is meta and HOST_METADATA_KEY not in moved
    assert pop_host_metadata({"input": torch.zeros(1)}) is None


def test_cu_seqlens_hand_examples():
    meta = HostMetadata(torch.tensor([[0, 1, 2, 0, 1], [0, 3, 0, 1, 2]]))
    # Every row start is a document start: a boundary at global index 5.
    assert meta.cu_seqlens().tolist() == [0, 3, 5, 7, 10]
    assert meta.seqlens().tolist() == [3, 2, 2, 3]
    assert meta.num_documents == 4 and meta.num_tokens == 10
    assert (meta.batch_size, meta.seq_len) == (2, 5)
    assert HostMetadata(torch.zeros(2, 2, dtype=torch.long)).cu_seqlens().tolist() == [
        0,
        1,
        2,
        3,
        4,
    ]
    three_rows = HostMetadata(torch.tensor([[0, 1, 2], [0, 4, 5], [0, 0, 1]]))
    assert three_rows.cu_seqlens().tolist() == [0, 3, 6, 7, 9]
    assert three_rows.cu_seqlens().dtype == torch.int64
    # torchtitan's packing restarts positions at 0 in every row; anything else is bad input
    # that the routing would silently misplace, so it is an error naming the row.
    with pytest.raises(ValueError, match="row 1 starts at position 2"):
        HostMetadata(torch.tensor([[0, 1, 2, 0, 1], [2, 3, 0, 1, 2]])).cu_seqlens()


def test_host_metadata_rejects_bad_positions():
    with pytest.raises(ValueError):
        HostMetadata(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError):
        HostMetadata(torch.zeros(1, 4, dtype=torch.int32))


def test_host_metadata_and_collate_pickle():
    # Dataloader workers send batches between processes.
    samples = [({"input": torch.arange(4), "positions": torch.tensor([0, 1, 0, 1])}, torch.ones(4))]
    input_dict, labels = pickle.loads(pickle.dumps(collate_with_host_metadata(samples)))
    assert input_dict[HOST_METADATA_KEY].cu_seqlens().tolist() == [0, 2, 4]
    assert labels.shape == (1, 4)
    assert pickle.loads(pickle.dumps(collate_with_host_metadata)) is collate_with_host_metadata


def test_collate_counts_the_labels_that_count_in_the_loss():
    # The trainer normalises the loss by this host count instead of reading the device.
    from torchtitan.components.loss import IGNORE_INDEX

    from torchtitan_cp import compat

    compat.apply()  # before torchtitan's trainer module binds the device names
    from torchtitan_cp.trainer.trainer import _host_valid_tokens

    pos = torch.tensor([0, 1, 2, 0, 1])
    samples = [
        ({"input": torch.arange(5), "positions": pos}, torch.tensor([1, 2, IGNORE_INDEX, 3, 4])),
        ({"input": torch.arange(5), "positions": pos}, torch.full((5,), IGNORE_INDEX)),
    ]
    input_dict, labels = collate_with_host_metadata(samples)
    assert input_dict[HOST_METADATA_KEY].valid_tokens == 4
    assert _host_valid_tokens(input_dict, labels) == 4
    input_dict.pop(HOST_METADATA_KEY)  # another loader's batch: counted on its host labels
    assert _host_valid_tokens(input_dict, labels) == 4


def test_host_metadata_can_be_turned_off(tokenizer):
    input_dict, _ = next(iter(build(tokenizer, PackedTextDataLoader.Config(host_metadata=False))))
    assert set(input_dict) == {"input", "positions"}


def test_data_parallel_ranks_see_different_data(tokenizer):
    rank0 = next(iter(build(tokenizer, dp_rank=0, dp_world_size=2)))[0]["input"]
    rank1 = next(iter(build(tokenizer, dp_rank=1, dp_world_size=2)))[0]["input"]
    assert rank0.shape == rank1.shape == (BATCH, SEQ_LEN)
    assert not torch.equal(rank0, rank1)
    # Each rank reads its own half of the documents, not a shifted copy of the stream.
    assert not torch.equal(rank0[:, :16], rank1[:, :16])


def test_state_dict_resumes_on_the_same_next_batch(tokenizer):
    loader = build(tokenizer)
    it = iter(loader)
    for _ in range(3):
        next(it)
    # torchtitan's checkpointer stores this dict via DCP; pickle stands in for it here.
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    want_in, want_lab = next(it)

    resumed = build(tokenizer)
    resumed.load_state_dict(state)
    got_in, got_lab = next(iter(resumed))
    assert torch.equal(got_in["input"], want_in["input"])
    assert torch.equal(got_lab, want_lab)
    assert torch.equal(got_in["positions"], want_in["positions"])
    assert torch.equal(got_in[HOST_METADATA_KEY].positions, want_in["positions"])
    # And it did not just restart: a fresh loader's first batch is different.
    assert not torch.equal(next(iter(build(tokenizer)))[0]["input"], want_in["input"])


def test_validation_reads_the_held_out_split(tokenizer):
    validator_cfg = Validator.Config(
        enable=True, steps=-1, dataloader=PackedValidationDataLoader.Config()
    )
    # What Validator.__init__ / validate() do with it.
    dl_cfg = replace(validator_cfg.dataloader, infinite=validator_cfg.steps != -1)
    loader = build(tokenizer, dl_cfg, seq_len=256)
    assert isinstance(loader, PackedValidationDataLoader)
    batches = list(loader)  # finite: one pass over the held-out documents
    assert 10 < len(batches) < 100
    want_in, _, _ = expected_rows(tokenizer, read_texts(BUNDLED_VALIDATION_PATH), BATCH, 256)
    assert torch.equal(batches[0][0]["input"], want_in)
    train_first = next(iter(build(tokenizer, seq_len=256)))[0]["input"]
    assert not torch.equal(batches[0][0]["input"], train_first)
    assert all(HOST_METADATA_KEY in b[0] for b in batches)


def test_jsonl_dataset_reads_any_local_file(tokenizer, tmp_path):
    path = tmp_path / "tiny.jsonl"
    texts = [f"Document number {i}. " + "word " * (5 * i) for i in range(1, 40)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = PackedTextDataLoader.Config(dataset="jsonl", dataset_path=str(path), infinite=False)
    input_dict, labels = next(iter(build(tokenizer, cfg, seq_len=32, batch=2)))
    want_in, want_lab, want_pos = expected_rows(tokenizer, texts, 2, 32)
    assert torch.equal(input_dict["input"], want_in)
    assert torch.equal(input_dict["positions"], want_pos)
    with pytest.raises(ValueError, match="dataset_path"):
        build(tokenizer, PackedTextDataLoader.Config(dataset="jsonl"))


# The loader's own errors, for launches that skip the pre-launch check: the same "path:line"
# messages as torchtitan_cp.data.jsonl.scan (tests/test_validate.py), not a datasets traceback.
BAD_JSONL = [
    (b"", ": empty file: no documents"),
    (b'{"text": "a"}\n{"text": "b"\n', ":2: malformed JSON"),
    (b'{"text": "a"}\n{"body": "b"}\n', ':2: no "text" key (keys: body)'),
    (b'{"text": "a"}\n{"text": null}\n', ':2: "text" is null, expected a string'),
    (b'{"text": "a"}\n{"text": 5}\n', ':2: "text" is int, expected a string'),
    (b'{"text": "a"}\n{"text": "caf\xe9"}\n', ":2: not UTF-8"),
    (b'{"text": "a"}\n\n{"text": "b"}\n', ":2: blank line"),
    (b'{"text": ""}\n{"text": ""}\n', ': all 2 documents have an empty "text"'),
]  # fmt: skip # a table, laid out by hand to read across


@pytest.mark.parametrize("data, message", BAD_JSONL, ids=[m for _, m in BAD_JSONL])
def test_bad_jsonl_file_is_named_with_its_line(tokenizer, tmp_path, data, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(data)
    cfg = PackedTextDataLoader.Config(dataset="jsonl", dataset_path=str(path), infinite=False)
    with pytest.raises(DataError) as info:
        list(build(tokenizer, cfg, seq_len=8, batch=1))
    assert str(info.value).startswith(f"{path}{message}"), str(info.value)
    assert "\n" not in str(info.value)


def test_missing_jsonl_file(tokenizer, tmp_path):
    cfg = PackedTextDataLoader.Config(dataset="jsonl", dataset_path=str(tmp_path / "no.jsonl"))
    with pytest.raises(DataError, match="no.jsonl: no such file"):
        build(tokenizer, cfg)


def test_fewer_documents_than_data_parallel_ranks(tokenizer, tmp_path):
    """Every rank raises the same line (before: rank 1 IndexError, rank 0 a lost connection)."""
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"text": "only one"}) + "\n")
    cfg = PackedTextDataLoader.Config(dataset="jsonl", dataset_path=str(path))
    for rank in (0, 1):
        with pytest.raises(DataError, match=r"1 document\(s\) for 2 data-parallel ranks"):
            build(tokenizer, cfg, dp_rank=rank, dp_world_size=2)
    build(tokenizer, cfg, dp_rank=0, dp_world_size=1)


def test_rank_whose_documents_are_all_empty(tokenizer, tmp_path):
    path = tmp_path / "half.jsonl"
    texts = ["", "", "real words here", "and more words"]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = PackedTextDataLoader.Config(dataset="jsonl", dataset_path=str(path))
    with pytest.raises(DataError, match='data-parallel rank 0 all have an empty "text"'):
        build(tokenizer, cfg, dp_rank=0, dp_world_size=2)
    build(tokenizer, cfg, dp_rank=1, dp_world_size=2)
