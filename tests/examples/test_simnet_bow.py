"""SimNet-BOW on LoD inputs: trains single-process (the hinge loss falls, the positive title outranks the
negative one on held-out pairs) and under ``python -m runtime.launch --server_num 2 --worker_num 2`` (every
process exits 0, both sync trainers end with the same parameters, so the same test accuracy).

Bars, with the figures measured when they were set (4,000 generated triples, 2 epochs, batch 64, lr 1.0):
single process loss 0.12 -> 0.02 and test pairwise accuracy 0.87; 2x2 sync loss 0.10 -> 0.01, accuracy
0.79 on each trainer (each trainer sees half the batches, and the pservers average the two gradients).
"""
from __future__ import annotations

import pathlib

import pytest

from examples.simnet_bow import data
from examples.simnet_bow import train as simnet_train
from tests.examples.test_examples_distributed import launch, trainer_values

ARGS = ["--samples", "4000", "--epochs", "2", "--lr", "1.0", "--log-every", "20"]


def test_data_is_deterministic_variable_length_and_never_padding() -> None:
    a, b = data.generate(50, seed=3), data.generate(50, seed=3)
    assert a == b and data.generate(50, seed=3, draw=1) != a
    lengths = {len(seq) for sample in a for seq in sample}
    assert len(lengths) > 3 and min(lengths) >= 2
    assert all(0 < w < 1000 for sample in a for seq in sample for w in seq)


def test_simnet_bow_trains(capsys: pytest.CaptureFixture[str]) -> None:
    result = simnet_train.main(ARGS)
    out = capsys.readouterr().out
    assert "examples/s" in out and "test pairwise accuracy: " in out
    assert result["steps"] == 2 * (4000 // 64)
    assert result["final_loss"] < result["first_loss"] / 2
    assert result["test_accuracy"] > 0.8


@pytest.mark.serial  # a launched job
def test_simnet_bow_distributed(tmp_path: pathlib.Path) -> None:
    out = launch(tmp_path / "logs", "examples/simnet_bow/train.py", *ARGS)
    losses = trainer_values(out, r"loss (\d+\.\d+) -> (\d+\.\d+)")
    acc = trainer_values(out, r"test pairwise accuracy: (\d\.\d+)")
    assert sorted(losses) == [0, 1] and sorted(acc) == [0, 1], out[-2000:]
    assert acc[0] == acc[1], out[-2000:]
    for t in (0, 1):
        first, last = (float(v) for v in losses[t])
        assert last < first / 2
    assert float(acc[0][0]) > 0.7
