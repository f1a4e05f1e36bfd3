"""The ResNet example's model: a CIFAR-style ResNet-(6n+2) (He et al., 2016, section 4.2).

A 3x3 conv-bn-relu stem of ``width`` channels; three stages of ``n`` basic blocks (two 3x3 conv-bn
layers and a residual ``elementwise_add``, relu after the add) of ``width``, ``2·width`` and ``4·width``
channels, the second and third stage starting with stride 2 and a 1x1 conv-bn projection shortcut;
global average ``pool2d``; ``fc`` to the classes; ``softmax_with_cross_entropy``, mean loss, accuracy;
Momentum. Convolutions have no bias (batch norm follows each), as in Fluid's ResNet models.

``build_model`` builds fresh (main, startup, test) programs under a fresh unique-name generator, so the
parameter names are the same in every build and every process. ``test`` is the forward-only clone
taken before the optimizer, with ``is_test`` set on its batch-norm ops (they normalise with the moving
statistics the training program updates in place).
"""
from __future__ import annotations

from dataclasses import dataclass

import ir
from flotilla.fluid import layers, optimizer
from ir.names import unique_name
from flotilla.fluid.regularizer import L2Decay


@dataclass(frozen=True)
class ResNetModel:
    """The built programs and the variables a training loop feeds and fetches."""

    main: ir.Program
    startup: ir.Program
    test: ir.Program
    feeds: tuple[str, ...]
    loss: ir.Variable
    accuracy: ir.Variable
    predict: ir.Variable


def conv_bn(x: ir.Variable, channels: int, filter_size: int, stride: int = 1, act: str | None = "relu") -> ir.Variable:
    """conv2d (no bias, 'same' padding) then batch_norm with ``act``."""
    conv = layers.conv2d(x, channels, filter_size, stride=stride, padding=(filter_size - 1) // 2, bias_attr=False)
    return layers.batch_norm(conv, act=act)


def basic_block(x: ir.Variable, channels: int, stride: int) -> ir.Variable:
    """relu(bn(conv(relu(bn(conv(x))))) + shortcut(x)); the shortcut projects when the shape changes."""
    h = conv_bn(x, channels, 3, stride)
    h = conv_bn(h, channels, 3, 1, act=None)
    shortcut = x if stride == 1 and x.shape[1] == channels else conv_bn(x, channels, 1, stride, act=None)
    return layers.elementwise_add(h, shortcut, act="relu")


def build_model(depth: int = 8, width: int = 16, num_classes: int = 10, image_shape: tuple[int, int, int] = (3, 32, 32),
                learning_rate: float = 0.05, momentum: float = 0.9, weight_decay: float = 1e-4) -> ResNetModel:
    """The ResNet-``depth`` classifier (depth = 6n + 2: 8, 14, 20, ...) of ``image`` [N, C, H, W] float32
    into ``num_classes`` classes (``label`` int64 [N, 1])."""
    if depth < 8 or (depth - 2) % 6:
        raise ValueError(f"ResNet depth must be 6n + 2 with n >= 1 (8, 14, 20, ...), got {depth}")
    blocks = (depth - 2) // 6
    main, startup = ir.Program(), ir.Program()
    with ir.program_guard(main, startup), unique_name.guard():
        image = layers.data("image", list(image_shape), dtype="float32")
        label = layers.data("label", [1], dtype="int64")
        h = conv_bn(image, width, 3)
        for stage, channels in enumerate((width, 2 * width, 4 * width)):
            for i in range(blocks):
                h = basic_block(h, channels, 2 if stage > 0 and i == 0 else 1)
        pooled = layers.pool2d(h, pool_type="avg", global_pooling=True)
        logits = layers.fc(pooled, num_classes)
        loss_per_example, predict = layers.softmax_with_cross_entropy(logits, label, return_softmax=True)
        loss = layers.mean(loss_per_example)
        accuracy = layers.accuracy(predict, label)
        test = main.clone(for_test=True)  # is_test set on batch norm and dropout
        optimizer.Momentum(learning_rate=learning_rate, momentum=momentum,
                           regularization=L2Decay(weight_decay)).minimize(loss)
    return ResNetModel(main, startup, test, ("image", "label"), loss, accuracy, predict)
