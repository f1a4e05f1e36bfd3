"""The collective benchmarks' models (``examples/resnet``, ``examples/transformer``) train single-process.

- Each model, seeded, trains a few steps at a small size and its loss falls by a stated margin (the
  mean of the last steps against the mean of the first ones; margins measured when set are in the
  test docstrings), and training is reproducible: the same seed gives the same losses.
- Each ``train.main`` runs end to end at a tiny size and prints its progress and accuracy lines;
  ``build``/``batches`` give what a benchmark needs.
- Conv2d, batch norm (train mode), max and average pool2d, residual adds, layer norm, gelu, multi-head
  attention and dropout compose: the gradients the backward program computes agree with directional
  central differences of the loss (float64), and batch norm's moving statistics are updated in place
  by the training program and used by the test program.
- ``layers.layer_norm`` and ``layers.gelu`` build Fluid 1.5's ops, parameters and initialisers and name
  a bad argument.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

import ir
import runtime
from examples.resnet import data as resnet_data
from examples.resnet import train as resnet_train
from examples.resnet.model import basic_block, conv_bn
from examples.transformer import data as transformer_data
from examples.transformer import train as transformer_train
from examples.transformer.model import encoder_layer
from flotilla.fluid import layers, optimizer
from ir.backward import append_backward
from ir.names import unique_name

RESNET_SMALL = ["--width", "8", "--batch-size", "16", "--seed", "3"]
TRANSFORMER_SMALL = ["--d-model", "32", "--heads", "4", "--d-ff", "64", "--layers", "1", "--batch-size", "32",
                     "--lr", "0.003", "--seed", "3"]


def _losses(train: Any, argv: list[str], steps: int) -> list[float]:
    """The per-step training losses of ``train``'s model over ``steps`` batches, single process."""
    args = train.parse_args(argv)
    main, startup, loss, feeds = train.build(args)
    scope, exe = runtime.Scope(), runtime.Executor(runtime.CPUPlace())
    exe.run(startup, scope=scope)
    out = []
    for feed in train.batches(args, steps):
        assert tuple(feed) == feeds
        (value,) = exe.run(main, feed=feed, fetch_list=[loss], scope=scope)
        out.append(float(value[0]))
    exe.close()
    return out


def test_resnet_loss_falls() -> None:
    """Measured: the mean loss over steps 1-3 is ~2.5 (ln 10 = 2.3 is chance), over steps 16-20 ~0.8."""
    losses = _losses(resnet_train, RESNET_SMALL, 20)
    assert np.isfinite(losses).all()
    assert np.mean(losses[:3]) > 1.8
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:3]), losses


def test_transformer_loss_falls() -> None:
    """Measured (seeds 3 and 4): the first loss is ~0.69 (ln 2, chance), the mean over steps 1-5
    0.86-0.89 (Adam's first steps overshoot), over steps 26-30 0.40."""
    losses = _losses(transformer_train, TRANSFORMER_SMALL, 30)
    assert np.isfinite(losses).all()
    assert np.mean(losses[-5:]) < 0.55, losses
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5]), losses


def test_training_is_reproducible() -> None:
    """Two builds initialise alike and train alike (dropout included): what lets every trainer of a
    collective job start from the same parameters. (One model suffices: both build the same way.)"""
    assert _losses(transformer_train, TRANSFORMER_SMALL, 3) == _losses(transformer_train, TRANSFORMER_SMALL, 3)


@pytest.mark.parametrize("train,argv", [(resnet_train, RESNET_SMALL), (transformer_train, TRANSFORMER_SMALL)],
                         ids=["resnet", "transformer"])
def test_main_prints_progress_and_accuracy(train: Any, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    result = train.main(argv + ["--steps", "4", "--log-every", "2", "--test-size", "64"])
    out = capsys.readouterr().out
    assert "examples/s" in out and "test accuracy: " in out and "step     4" in out
    assert result["steps"] == 4 and 0.0 <= result["test_accuracy"] <= 1.0
    assert np.isfinite(result["final_loss"]) and result["examples_per_s"] > 0


def test_data_is_deterministic_and_shaped() -> None:
    x, y = resnet_data.generate(8, seed=1, draw=2)
    x2, y2 = resnet_data.generate(8, seed=1, draw=2)
    assert x.shape == (8, 3, 32, 32) and x.dtype == np.float32 and y.shape == (8, 1) and y.dtype == np.int64
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    assert not np.array_equal(x, resnet_data.generate(8, seed=1, draw=3)[0])
    ids, labels = transformer_data.generate(16, seed=1)
    assert ids.shape == (16, transformer_data.SEQ_LEN) and ids.dtype == np.int64
    assert ids.min() >= 0 and ids.max() < transformer_data.VOCAB_SIZE
    markers = transformer_data.marker_sets(1)
    for row, label in zip(ids, labels[:, 0]):  # the label is the class with more markers
        counts = [np.isin(row, markers[c]).sum() for c in (0, 1)]
        assert counts[label] > counts[1 - label]


# --- gradients of the composed layers ---------------------------------------------------------------------
def _check_program_gradients(build: Callable[[], ir.Variable], feed: dict[str, np.ndarray], seed: int = 0) -> None:
    """Build the loss under fresh programs, append backward, and compare every parameter's gradient with
    a directional central difference of the loss (float64; a random direction per parameter)."""
    main, startup = ir.Program(), ir.Program()
    with ir.program_guard(main, startup), unique_name.guard():
        loss = build()
        pairs = append_backward(loss)
    scope, exe = runtime.Scope(), runtime.Executor(runtime.CPUPlace())
    exe.run(startup, scope=scope)
    rng = np.random.default_rng(seed)
    params = [p.name for p, _ in pairs]
    for name in params:  # move Constant-initialised parameters (bn scale 1, biases 0) off their defaults
        value = scope.numpy(name)
        scope.set_var(name, value + rng.normal(0.0, 0.1, value.shape))
    # Every run fetches the same list: the executor compiles a program once per fetch list, and compiling
    # (about 1.5 s for the ResNet block) is most of this test.
    fetch = [loss] + [g for _, g in pairs]
    values = exe.run(main, feed=feed, fetch_list=fetch, scope=scope)
    grads = dict(zip(params, values[1:]))
    eps = 1e-6
    for name in params:
        base = scope.numpy(name).copy()
        direction = rng.normal(size=base.shape)
        at = []
        for sign in (1.0, -1.0):
            scope.set_var(name, base + sign * eps * direction)
            at.append(float(exe.run(main, feed=feed, fetch_list=fetch, scope=scope)[0][0]))
        scope.set_var(name, base)
        numeric = (at[0] - at[1]) / (2 * eps)
        analytic = float(np.sum(grads[name] * direction))
        assert analytic == pytest.approx(numeric, rel=1e-5, abs=1e-8), name
    exe.close()


def test_resnet_block_gradients_match_finite_differences() -> None:
    rng = np.random.default_rng(0)
    feed = {"image": rng.normal(size=(4, 3, 8, 8)), "label": rng.integers(0, 3, size=(4, 1)).astype(np.int64)}

    def build() -> ir.Variable:
        image = layers.data("image", [3, 8, 8], dtype="float64")
        label = layers.data("label", [1], dtype="int64")
        h = conv_bn(image, 4, 3)
        h = basic_block(h, 4, 1)  # identity shortcut
        h = basic_block(h, 6, 2)  # projection shortcut, stride 2
        h = layers.pool2d(h, pool_size=2, pool_type="max", pool_stride=2)
        h = layers.pool2d(h, pool_type="avg", global_pooling=True)
        logits = layers.fc(h, 3)
        return layers.mean(layers.softmax_with_cross_entropy(logits, label))

    _check_program_gradients(build, feed)


def test_transformer_layer_gradients_match_finite_differences() -> None:
    rng = np.random.default_rng(1)
    feed = {"x": rng.normal(size=(3, 5, 8)), "label": rng.integers(0, 2, size=(3, 1)).astype(np.int64)}

    def build() -> ir.Variable:
        x = layers.data("x", [5, 8], dtype="float64")
        label = layers.data("label", [1], dtype="int64")
        h = encoder_layer(x, 8, 2, 16, dropout=0.0)  # dropout is random: its grad is covered by op samples
        logits = layers.fc(layers.reduce_mean(h, dim=[1]), 2)
        return layers.mean(layers.softmax_with_cross_entropy(logits, label))

    _check_program_gradients(build, feed)


def test_batch_norm_moving_stats_update_in_place_and_feed_the_test_program() -> None:
    main, startup = ir.Program(), ir.Program()
    with ir.program_guard(main, startup), unique_name.guard():
        x = layers.data("x", [2, 3, 3], dtype="float32")
        y = layers.batch_norm(x, momentum=0.5)
        out = layers.mean(y)
        test = main.clone(for_test=True)
        optimizer.SGD(learning_rate=0.1).minimize(out)
    (bn,) = [op for op in main.global_block().ops if op.type == "batch_norm"]
    mean_name, var_name = bn.input("Mean")[0], bn.input("Variance")[0]
    assert bn.output("MeanOut") == [mean_name] and bn.output("VarianceOut") == [var_name]
    scope, exe = runtime.Scope(), runtime.Executor(runtime.CPUPlace())
    exe.run(startup, scope=scope)
    batch = np.random.default_rng(2).normal(1.0, 2.0, size=(8, 2, 3, 3)).astype(np.float32)
    exe.run(main, feed={"x": batch}, fetch_list=[out], scope=scope)
    mean, var = scope.numpy(mean_name), scope.numpy(var_name)
    np.testing.assert_allclose(mean, 0.5 * batch.mean((0, 2, 3)), rtol=1e-5)
    np.testing.assert_allclose(var, 0.5 + 0.5 * batch.var((0, 2, 3)), rtol=1e-5)
    (test_bn,) = [op for op in test.global_block().ops if op.type == "batch_norm"]
    assert test_bn.attr("is_test")
    (y_test,) = exe.run(test, feed={"x": batch}, fetch_list=[y], scope=scope)
    scale, bias = scope.numpy(bn.input("Scale")[0]), scope.numpy(bn.input("Bias")[0])
    assert not np.allclose(bias, 0.0)  # the optimizer updated it
    expected = ((batch - mean[None, :, None, None]) / np.sqrt(var[None, :, None, None] + 1e-5)
                * scale[None, :, None, None] + bias[None, :, None, None])
    np.testing.assert_allclose(y_test, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(scope.numpy(mean_name), mean)  # the test program leaves them be


# --- the layers the models added ------------------------------------------------------------------------
def test_layer_norm_and_gelu_layers_build_fluid_ops() -> None:
    main, startup = ir.Program(), ir.Program()
    with ir.program_guard(main, startup), unique_name.guard():
        x = layers.data("x", [5, 8], dtype="float32")
        y = layers.layer_norm(x, begin_norm_axis=2, epsilon=1e-6, act="gelu")
        z = layers.layer_norm(layers.gelu(x), scale=False, shift=False)
        w = layers.fc(x, 4, num_flatten_dims=2, act="gelu")
    ops = main.global_block().ops
    assert [op.type for op in ops] == ["layer_norm", "gelu", "gelu", "layer_norm", "mul", "elementwise_add", "gelu"]
    ln = ops[0]
    assert ln.attr("begin_norm_axis") == 2 and ln.attr("epsilon") == pytest.approx(1e-6)
    scale, bias = (main.global_block().var(ln.input(s)[0]) for s in ("Scale", "Bias"))
    assert scale.shape == (8,) and bias.shape == (8,) and scale.trainable and bias.trainable
    assert main.global_block().var(ln.output("Mean")[0]).shape == (-1,)
    assert not ops[3].input("Scale") and not ops[3].input("Bias")
    assert main.global_block().var(ops[3].output("Mean")[0]).shape == (-1,)
    assert y.shape == z.shape == (-1, 5, 8) and w.shape == (-1, 5, 4)
    init = {op.output("Out")[0]: op for op in startup.global_block().ops}
    assert init[scale.name].type == "fill_constant" and init[scale.name].attr("value") == 1.0
    assert init[bias.name].type == "fill_constant" and init[bias.name].attr("value") == 0.0


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"begin_norm_axis": 3}, "begin_norm_axis 3 must be in \\[1, 3\\)"),
    ({"begin_norm_axis": 0}, "begin_norm_axis 0 must be in"),
    ({"param_attr": False}, "param_attr cannot be False when scale is True"),
])
def test_layer_norm_layer_rejects(kwargs: dict[str, Any], match: str) -> None:
    with ir.program_guard(ir.Program(), ir.Program()), unique_name.guard():
        x = layers.data("x", [5, 8], dtype="float32")
        with pytest.raises(ir.IRError, match=match):
            layers.layer_norm(x, **kwargs)
