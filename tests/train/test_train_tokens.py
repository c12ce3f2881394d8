"""Tokenized data: a Hugging Face tokenizer (the `tokenizers` library) for text corpora, token
files (raw uint16/uint32 ids, memory-mapped) and the data hash over them; byte-level stays the
default. Every tokenizer and file is made in the test."""

from __future__ import annotations

import hashlib
import sys

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dtfm.train import (ByteTokenizer, Corpus, GPTSpec, GPTStage, LocalCluster, Plan, TrainConfig, TokenizerError,
                        export_hf, load_corpus, load_token_file, load_tokenizer, sample_text, tokenize_to_file,
                        write_byte_tokenizer, write_token_file)
from dtfm.train.cli import main

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n# a comment about item {i}\n" for i in range(300))


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A byte-level BPE of 400 ids trained on TEXT, saved as tokenizer.json and as vocab.json + merges.txt."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    d = tmp_path_factory.mktemp("bpe")
    tok.save(str(d / "tokenizer.json"))
    tok.model.save(str(d))  # vocab.json, merges.txt
    return d


def test_hf_tokenizer_from_either_file_set_round_trips(bpe_dir, tmp_path):
    tok = load_tokenizer(bpe_dir)
    assert tok.vocab == 400
    ids = tok.encode(TEXT[:500])
    assert ids.dtype == np.uint16 and len(ids) < 250 and tok.decode(ids) == TEXT[:500]
    for name in ("vocab.json", "merges.txt"):
        (tmp_path / name).write_bytes((bpe_dir / name).read_bytes())
    assert np.array_equal(load_tokenizer(tmp_path).encode(TEXT[:500]), ids)
    with pytest.raises(TokenizerError, match="not a folder"):
        load_tokenizer(tmp_path / "vocab.json")
    (tmp_path / "merges.txt").unlink()
    with pytest.raises(TokenizerError, match="no tokenizer files"):
        load_tokenizer(tmp_path)


def test_missing_tokenizers_package_is_a_clear_error(bpe_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(TokenizerError, match=r"pip install 'dtfm\[hf\]'"):
        load_tokenizer(bpe_dir)


def test_byte_tokenizer_file_is_the_byte_tokenizer(tmp_path):
    write_byte_tokenizer(tmp_path)
    text = "héllo\n\t  wörld ✓ \x00\x7f"
    tok = load_tokenizer(tmp_path)
    assert tok.vocab == 256 and list(tok.encode(text)) == list(ByteTokenizer().encode(text))
    assert tok.decode(tok.encode(text)) == text


def test_byte_corpus_hash_is_the_sha256_of_its_bytes(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    c = load_corpus(tmp_path / "a.txt")
    assert c.tokens.dtype == np.uint8 and c.fingerprint == hashlib.sha256(TEXT.encode()).hexdigest()


def test_text_tokenized_by_a_folder_file_and_memory_agree(bpe_dir, tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    tok = load_tokenizer(bpe_dir)
    mem = load_corpus(tmp_path / "a.txt", tokenizer=tok)
    assert mem.tokens.dtype == np.uint16 and np.array_equal(mem.tokens, tok.encode(TEXT))
    assert mem.fingerprint != load_corpus(tmp_path / "a.txt").fingerprint and "hf:" in mem.name
    # Streamed into a token file in small blocks cut after newlines: the same ids, the same hash.
    out, n = tokenize_to_file(tmp_path / "a.txt", tok, tmp_path / "train.bin", block_bytes=100)
    assert n == len(mem.tokens) and out.stat().st_size == 2 * n
    disk = load_corpus(out)
    assert isinstance(disk.tokens, np.memmap)
    assert np.array_equal(disk.tokens, mem.tokens) and disk.fingerprint == mem.fingerprint
    x1, y1 = disk.batch(3, 5, range(4), 16)
    x2, y2 = mem.batch(3, 5, range(4), 16)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and x1.dtype == torch.int64


def test_token_files_dtype_size_and_vocabulary_checks(tmp_path):
    ids = np.array([0, 70000, 5, 65536, 1] * 20, dtype=np.int64)
    p = write_token_file(tmp_path / "big.uint32.bin", ids, "uint32")
    c = load_corpus(p)
    assert c.tokens.dtype.name == "uint32" and list(c.tokens[:2]) == [0, 70000] and c.max_token == 70000
    with pytest.raises(ValueError, match="outside uint16"):
        write_token_file(tmp_path / "x.bin", ids, "uint16")
    same16 = Corpus(np.array([1, 2, 3], dtype=np.uint16), "a")
    same32 = Corpus(np.array([1, 2, 3], dtype=np.uint32), "b")
    assert same16.fingerprint != same32.fingerprint  # the dtype is part of what peers compare
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match="whole number of uint16"):
        load_corpus(tmp_path / "odd.bin")
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(tmp_path / "none.bin")
    with pytest.raises(ValueError, match="holds token id 70000"):
        c.check_vocab(50257)
    spec = GPTSpec("t", n_layer=2, n_embd=16, n_head=2, seq_len=8)  # vocabulary 256
    with pytest.raises(ValueError, match="holds token id"):
        LocalCluster(spec, TrainConfig(global_batch_seqs=2, micro_batches=1), Plan.grid(2, 1, 1), c)
    assert load_token_file(p, "uint16").tokens.dtype.name == "uint16"  # an explicit dtype wins


def test_training_on_a_token_file_matches_the_same_text_in_memory(tmp_path):
    """Byte ids in a uint16 token file give the byte corpus's batches, hence its losses."""
    write_token_file(tmp_path / "t.bin", ByteTokenizer().encode(TEXT), "uint16")
    (tmp_path / "t.txt").write_text(TEXT)
    spec = GPTSpec("t", n_layer=2, n_embd=16, n_head=2, seq_len=8)
    cfg = TrainConfig(global_batch_seqs=4, micro_batches=2)
    losses = []
    for corpus in (load_corpus(tmp_path / "t.bin"), load_corpus(tmp_path / "t.txt")):
        with LocalCluster(spec, cfg, Plan.grid(2, 2, 1), corpus) as cl:
            losses.append(cl.run(2))
    assert losses[0] == losses[1]


def test_cli_tokenize_then_train_and_sample_with_the_folders_tokenizer(bpe_dir, tmp_path, capsys):
    (tmp_path / "a.txt").write_text(TEXT)
    assert main(["tokenize", "--tokenizer", str(bpe_dir), "--data", str(tmp_path / "a.txt"),
                 "--out", str(tmp_path / "train.bin")]) == 0
    assert "uint16 tokens" in capsys.readouterr().err
    # the tiny preset has 256 ids; this tokenizer 400: refused in one line before any training
    assert main(["--data", str(tmp_path / "train.bin"), "--steps", "1", "--quiet"]) == 1
    assert "holds token id" in capsys.readouterr().err
    spec = GPTSpec("t", n_layer=2, n_embd=16, n_head=2, seq_len=16, vocab=400)
    out = export_hf(spec, GPTStage(spec, (0, 2), seed=0).state_dict(), tmp_path / "m", tokenizer_from=bpe_dir)
    assert (out / "tokenizer.json").is_file()
    text = sample_text(out, "def f1(x):", 5, temperature=0)
    assert text.startswith("def f1(x):") and len(text) > len("def f1(x):")
    assert main(["--init-from", str(out), "--data", str(tmp_path / "a.txt"), "--steps", "1", "--batch", "2",
                 "--micro-batches", "1", "--quiet"]) == 0  # text tokenized by the folder's own tokenizer
