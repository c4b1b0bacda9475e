"""`fastqwen token-map`: the MTP head's draft vocabulary, the most frequent token ids of a corpus."""
import json

import numpy as np
import pytest

from fastqwen import cli, token_map
from fastqwen.errors import UserError


def test_select_takes_the_most_frequent_ties_by_id_and_always_the_given_ids():
    counts = np.array([5, 0, 9, 5, 1, 9, 0, 2])
    assert token_map.select(counts, 3) == [0, 2, 5]            # 9, 9, then the lower id of the 5s
    assert token_map.select(counts, 3, always=[6]) == [2, 5, 6]
    assert token_map.select(counts, 8) == list(range(8))        # ids never seen fill by id
    with pytest.raises(UserError, match="--size 9: must lie in 1..8"):
        token_map.select(counts, 9)


def test_coverage_is_the_share_of_counted_tokens_in_the_map():
    counts = np.array([6, 0, 3, 1])
    assert token_map.coverage(counts, [0, 3]) == pytest.approx(0.7)
    assert token_map.coverage(np.zeros(4, dtype=np.int64), [0]) is None


def test_the_command_counts_the_checkpoints_tokens_and_writes_a_map_the_engine_reads(tiny_model, tmp_path):
    """On the tiny checkpoint's tokenizer: the counts are the tokenizer's ids over the text, the
    map the 40 most frequent, its coverage what the counts say, and the engine's loader takes it."""
    from tokenizers import Tokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat\nthe dog sat on the log\n" * 50)
    held = tmp_path / "held.txt"
    held.write_text("a bird sat on the cat\n")
    out, report = tmp_path / "map.pt", tmp_path / "report.json"
    assert cli.main(["token-map", "--model", str(tiny_model), "--corpus", str(corpus), "--size", "40",
                     "--out", str(out), "--check", str(held), "--report", str(report)]) == 0
    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    want = np.zeros(vocab, dtype=np.int64)
    for line in corpus.read_text().splitlines(keepends=True):
        want += np.bincount(tok.encode(line, add_special_tokens=False).ids, minlength=vocab)
    got = json.loads(report.read_text())
    ids = token_map.select(want, 40, got["always"])
    assert got["size"] == 40 and got["corpus_tokens"] == int(want.sum())
    assert got["coverage"] == pytest.approx(token_map.coverage(want, ids))
    assert got["distinct_tokens"] == int((want > 0).sum()) and got["coverage"] == pytest.approx(1.0)
    assert 0 < got["check_coverage"] <= 1

    from engine_modules import ENGINE_DIR, load_engine_module

    load_engine_module(ENGINE_DIR, "fastqwen_engine_token_map_under_test")
    import fq_spec

    assert fq_spec.load_token_map(str(out), vocab).tolist() == ids


def test_bad_arguments_are_errors_naming_them(tiny_model, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello\n")
    assert cli.main(["token-map", "--model", str(tiny_model), "--corpus", str(corpus), "--out",
                     str(tmp_path / "map.txt")]) == 2
    assert "--out" in capsys.readouterr().err and not (tmp_path / "map.txt").exists()
    assert cli.main(["token-map", "--model", str(tiny_model), "--corpus", str(tmp_path / "none.txt"),
                     "--out", str(tmp_path / "m.json")]) == 2
    assert "none.txt" in capsys.readouterr().err
    assert cli.main(["token-map", "--model", str(tmp_path), "--corpus", str(corpus),
                     "--out", str(tmp_path / "m.json")]) == 2
    assert "no config.json" in capsys.readouterr().err
