"""`jaxport gpt prepare` writes nanoGPT's files byte for byte (fixtures shakespeare_*_prepared)."""

import hashlib
import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from jaxport.errors import JaxportError
from jaxport.gpt import data

FIXTURES = Path(__file__).parent / "fixtures" / "gpt"
INPUT = FIXTURES / "tinyshakespeare" / "input.txt"
TOKENIZER = FIXTURES / "gpt2-tokenizer"


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def check_bins(out, case_dir):
    case = json.loads((case_dir / "case.json").read_text())
    e = np.load(case_dir / "expected.npz")
    assert sha256(INPUT) == case["input"]["sha256"]
    for f in case["files"]:
        if f["path"].endswith(".bin"):
            assert (out / f["path"]).stat().st_size == f["bytes"]
            assert sha256(out / f["path"]) == f["sha256"], f["path"]
    for split in ("train", "val"):
        ids = np.fromfile(out / f"{split}.bin", dtype=np.uint16)
        assert len(ids) == int(e[f"{split}_len"])
        np.testing.assert_array_equal(ids[:512], e[f"{split}_head"])
        np.testing.assert_array_equal(ids[-512:], e[f"{split}_tail"])
    return e


def test_prepare_shakespeare_char(tmp_path, capsys):
    case_dir = FIXTURES / "shakespeare_char_prepared"
    data.prepare("shakespeare_char", tmp_path / "sc", input_file=INPUT)
    e = check_bins(tmp_path / "sc", case_dir)
    case = json.loads((case_dir / "case.json").read_text())
    assert capsys.readouterr().out.splitlines() == case["prepare_stdout"]
    with open(tmp_path / "sc" / "meta.pkl", "rb") as f:
        meta = pickle.load(f)
    with open(case_dir / "meta.pkl", "rb") as f:
        assert meta == pickle.load(f)
    assert list(meta) == ["vocab_size", "itos", "stoi"] and meta["vocab_size"] == int(e["vocab_size"])
    assert [meta["itos"][i] for i in range(meta["vocab_size"])] == list(e["itos"])


def test_prepare_shakespeare_bpe_offline(tmp_path, capsys):
    case_dir = FIXTURES / "shakespeare_bpe_prepared"
    data.prepare("shakespeare", tmp_path / "s", input_file=INPUT, tokenizer_dir=TOKENIZER)
    check_bins(tmp_path / "s", case_dir)
    case = json.loads((case_dir / "case.json").read_text())
    assert capsys.readouterr().out.splitlines() == case["prepare_stdout"]


def test_gpt2_encoding_probes():
    case_dir = FIXTURES / "shakespeare_bpe_prepared"
    e, probes = np.load(case_dir / "expected.npz"), np.load(case_dir / "inputs.npz")["probe_text"]
    enc = data.gpt2_encoding(TOKENIZER)
    assert enc.eot_token == int(e["eot_token"]) and enc.n_vocab == int(e["n_vocab"])
    for kind, encode in (
        ("ordinary", enc.encode_ordinary),
        ("special", lambda s: enc.encode(s, allowed_special={"<|endoftext|>"})),
    ):
        ids, off = e[f"probe_{kind}_ids"], e[f"probe_{kind}_offsets"]
        for k, text in enumerate(probes):
            assert encode(str(text)) == ids[off[k] : off[k + 1]].tolist(), (kind, text)


def test_prepare_text_and_batches(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello jaxport, hello nanoGPT!\n" * 40)
    stats = data.prepare("text", tmp_path / "t", input_file=corpus, tokenizer="char")
    assert stats["vocab_size"] == len(set(corpus.read_text()))
    batches = data.Batches(tmp_path / "t", block_size=8, batch_size=3, seed=0)
    x, y = batches.get("train", (2,))
    assert x.shape == y.shape == (2, 3, 8) and x.dtype == np.int32
    train = np.fromfile(tmp_path / "t" / "train.bin", dtype=np.uint16)
    for row_x, row_y in zip(x.reshape(-1, 8), y.reshape(-1, 8)):
        start = next(i for i in range(len(train) - 8) if (train[i : i + 8] == row_x).all())
        np.testing.assert_array_equal(train[start + 1 : start + 9], row_y)


def test_prepare_openwebtext_from_local_jsonl(tmp_path):
    docs = [f"Document {i}: the quick brown fox, number {i * i}." for i in range(30)]
    corpus = tmp_path / "owt.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
    stats = data.prepare("openwebtext", tmp_path / "owt", input_file=corpus, tokenizer_dir=TOKENIZER)
    enc = data.gpt2_encoding(TOKENIZER)
    train = np.fromfile(tmp_path / "owt" / "train.bin", dtype=np.uint16)
    val = np.fromfile(tmp_path / "owt" / "val.bin", dtype=np.uint16)
    assert (stats["train"], stats["val"]) == (len(train), len(val))
    assert (train == enc.eot_token).sum() == 29 and (val == enc.eot_token).sum() == 1 and val[-1] == enc.eot_token
    held_out = enc.decode(val[:-1].tolist())
    assert held_out in docs
    expected = [t for d in docs if d != held_out for t in enc.encode_ordinary(d) + [enc.eot_token]]
    assert sorted(train.tolist()) == sorted(expected)  # every other document, each once, order shuffled
    (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
    with pytest.raises(JaxportError, match=r"bad.jsonl:1 is not a JSON object with a \"text\" field"):
        data.prepare("openwebtext", tmp_path / "bad", input_file=tmp_path / "bad.jsonl", tokenizer_dir=TOKENIZER)


def test_bad_data_inputs(tmp_path):
    with pytest.raises(
        JaxportError, match=r"data folder .*empty has no train.bin; create it with `jaxport gpt prepare"
    ):
        (tmp_path / "empty").mkdir()
        data.Batches(tmp_path / "empty", 8, 2)
    with pytest.raises(JaxportError, match="input file not found: .*nope.txt"):
        data.prepare("shakespeare_char", tmp_path / "x", input_file=tmp_path / "nope.txt")
    with pytest.raises(JaxportError, match="unknown dataset 'owt2'"):
        data.prepare("owt2", tmp_path / "x")
    with pytest.raises(JaxportError, match="GPT-2 tokenizer file missing: .*vocab.bpe"):
        data.gpt2_encoding(tmp_path)
