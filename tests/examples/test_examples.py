"""Each example's ``main(argv)`` trains to a stated quality at small sizes (a few seconds each).

Bars, with the margins measured when they were set: CTR test AUC > 0.75 (0.81–0.82 measured; the Bayes
AUC of the generator is about 0.91) and the program's ``auc`` op within 0.01 of the exact AUC; word2vec
loss falls by over a third and same-topic words end up at least 0.3 more cosine-similar than
different-topic ones (0.60 measured); MLP test accuracy > 0.9 (0.94–0.97 measured, Bayes 0.95–0.98).
"""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

from examples.ctr import data as ctr_data
from examples.ctr import train as ctr_train
from examples.mlp import train as mlp_train
from examples.word2vec import train as w2v_train


def test_ctr_reaches_test_auc(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = ctr_train.main(["--data-dir", str(tmp_path / "ctr"), "--generate", "20000", "--hash-dim", "10007",
                             "--epochs", "2", "--batch-size", "256", "--hidden", "64", "64", "--log-every", "40"])
    out = capsys.readouterr().out
    assert (tmp_path / "ctr" / "train.txt").exists() and (tmp_path / "ctr" / "test.txt").exists()
    assert "examples/s" in out and "test AUC: " in out
    assert result["steps"] == 2 * (20000 // 256)
    assert result["test_auc"] > 0.75
    assert abs(result["test_auc"] - result["test_auc_exact"]) < 0.01
    assert np.isfinite(result["final_loss"]) and result["final_loss"] < 0.6


def test_ctr_bulk_loader_matches_line_reader(tmp_path: pathlib.Path) -> None:
    ctr_data.generate(tmp_path / "d.txt", 300, seed=3)
    arrays = ctr_data.load_arrays(tmp_path / "d.txt", 1009)
    batches = list(ctr_data.read_batches([tmp_path / "d.txt"], 100, 1009))
    assert len(batches) == 3
    for key in ("dense_input", "sparse_input", "label"):
        np.testing.assert_array_equal(arrays[key], np.concatenate([b[key] for b in batches]))
    assert arrays["sparse_input"].max() < 1009 and arrays["sparse_input"].dtype == np.int64


def test_roc_auc_matches_pairwise_definition() -> None:
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 20, size=200).astype(float)  # many ties
    labels = rng.random(200) < 0.4
    pos, neg = scores[labels], scores[~labels]
    pairwise = ((pos[:, None] > neg[None]).sum() + 0.5 * (pos[:, None] == neg[None]).sum()) / (len(pos) * len(neg))
    assert ctr_train.roc_auc(scores, labels) == pytest.approx(pairwise)


def test_word2vec_loss_drops_and_topics_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    result = w2v_train.main(["--sentences", "3000", "--batch-size", "128", "--log-every", "200"])
    assert "examples/s" in capsys.readouterr().out
    assert result["final_loss"] < result["first_loss"] * 2 / 3
    assert result["same_topic"] - result["other_topic"] > 0.3


def test_mlp_reaches_accuracy(capsys: pytest.CaptureFixture[str]) -> None:
    result = mlp_train.main(["--train-size", "10000", "--epochs", "2", "--log-every", "40"])
    assert "examples/s" in capsys.readouterr().out
    assert result["test_accuracy"] > 0.9
