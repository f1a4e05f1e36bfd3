"""PyTorch twins of the ResNet and Transformer examples, for ``bench/collective_bench.py --vs-torch``.

Each twin has the example's architecture, sizes and optimizer, read from the same options
(``examples/<name>/train.py``'s ``parse_args``), so ``build(name, args)`` follows the example when its
defaults change:

- **ResNet** (``examples/resnet/model.py``): a CIFAR-style ResNet-(6n+2): a 3x3 conv-bn-relu stem of
  ``width`` channels, three stages of n basic blocks (``width``, ``2·width``, ``4·width`` channels; the
  second and third start with stride 2 and a 1x1 conv-bn projection shortcut), relu after the residual
  add, global average pooling, a linear layer to the classes; convolutions without bias; batch norm with
  Fluid's defaults (moving average 0.9, i.e. torch's ``momentum=0.1``, epsilon 1e-5); softmax cross
  entropy; Momentum with L2 decay on every parameter (``torch.optim.SGD(momentum, weight_decay)``, the same
  update as Fluid's ``Momentum`` + ``L2Decay``).
- **Transformer** (``examples/transformer/model.py``): token embedding (N(0, 0.02)) plus a learned
  ``[seq_len, d_model]`` position embedding, dropout; ``layers`` post-norm encoder layers, each
  multi-head self-attention (separate q, k, v and output projections with bias, scale 1/sqrt(d_head),
  dropout on the attention weights; ``F.scaled_dot_product_attention``, torch's own kernel for it) and a
  feed-forward block (``d_ff``, exact-erf gelu), each followed by dropout, the residual add and layer
  norm (epsilon 1e-5); mean over the sequence; a linear layer to the classes; softmax cross entropy; Adam.

Invariant (checked by ``tests/bench/test_collective_bench.py``): a twin's trainable parameters have the
example's shapes, one for one, up to the order of their axes (a torch ``Linear`` stores [out, in], a
Fluid ``fc`` [in, out]). Initialisers other than the embeddings' are torch's defaults: they change the
losses, not the cost of a step.

Only the benchmark imports this module; torch is a bench-only extra (``pip install -e '.[bench]'``).
"""
from __future__ import annotations

import argparse
import inspect
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from examples.resnet import data as resnet_data
from examples.resnet.model import build_model as build_fluid_resnet
from examples.transformer import data as transformer_data

MODELS = ("resnet", "transformer")


def _conv_bn(cin: int, cout: int, k: int, stride: int = 1) -> nn.Sequential:
    """conv (no bias, 'same' padding) then batch norm, as the example's ``conv_bn`` (activation apart)."""
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride=stride, padding=(k - 1) // 2, bias=False),
                         nn.BatchNorm2d(cout, eps=1e-5, momentum=0.1))


class BasicBlock(nn.Module):
    """relu(bn(conv(relu(bn(conv(x))))) + shortcut(x)); the shortcut projects when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.a = _conv_bn(cin, cout, 3, stride)
        self.b = _conv_bn(cout, cout, 3)
        self.shortcut = None if stride == 1 and cin == cout else _conv_bn(cin, cout, 1, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(F.relu(self.a(x)))
        return F.relu(h + (x if self.shortcut is None else self.shortcut(x)))


class ResNet(nn.Module):
    """The ResNet example's classifier of images [N, 3, 32, 32] into ``num_classes`` logits."""

    def __init__(self, depth: int, width: int, num_classes: int) -> None:
        super().__init__()
        if depth < 8 or (depth - 2) % 6:
            raise ValueError(f"ResNet depth must be 6n + 2 with n >= 1 (8, 14, 20, ...), got {depth}")
        blocks = (depth - 2) // 6
        self.stem = _conv_bn(3, width, 3)
        layers, cin = [], width
        for stage, cout in enumerate((width, 2 * width, 4 * width)):
            for i in range(blocks):
                layers.append(BasicBlock(cin, cout, 2 if stage > 0 and i == 0 else 1))
                cin = cout
        self.stages = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        h = self.stages(F.relu(self.stem(image)))
        return self.fc(h.mean(dim=(2, 3)))


class SelfAttention(nn.Module):
    """Multi-head self-attention of x [N, T, d_model], as the example's ``multi_head_attention``."""

    def __init__(self, d_model: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        self.num_heads, self.dropout = num_heads, dropout
        self.q, self.k, self.v, self.out = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:  # [N, T, d] -> [N, H, T, d_head]
            return y.view(n, t, self.num_heads, d // self.num_heads).transpose(1, 2)

        context = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)),
                                                 dropout_p=self.dropout if self.training else 0.0)
        return self.out(context.transpose(1, 2).reshape(n, t, d))


class EncoderLayer(nn.Module):
    """Post-norm: x = LN(x + drop(MHA(x))); x = LN(x + drop(FFN(x))), FFN with exact gelu."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.attn = SelfAttention(d_model, num_heads, dropout)
        self.norm1 = nn.LayerNorm(d_model, eps=1e-5)
        self.ff1, self.ff2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.norm2 = nn.LayerNorm(d_model, eps=1e-5)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.drop(self.attn(x)))
        return self.norm2(x + self.drop(self.ff2(F.gelu(self.ff1(x)))))


class Transformer(nn.Module):
    """The Transformer example's classifier of token ids [N, seq_len] into ``num_classes`` logits."""

    def __init__(self, vocab_size: int, seq_len: int, num_classes: int, d_model: int, num_heads: int,
                 num_layers: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model {d_model} must be divisible by num_heads {num_heads}")
        self.word_emb = nn.Embedding(vocab_size, d_model)
        nn.init.normal_(self.word_emb.weight, 0.0, 0.02)
        self.pos_emb = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.Sequential(*(EncoderLayer(d_model, num_heads, d_ff, dropout) for _ in range(num_layers)))
        self.fc = nn.Linear(d_model, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.layers(self.drop(self.word_emb(tokens) + self.pos_emb))
        return self.fc(h.mean(dim=1))


def build(name: str, args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``(model, optimizer)`` of the example ``name`` configured by ``args`` (its ``train.parse_args``)."""
    if name == "resnet":
        model: nn.Module = ResNet(args.depth, args.width, resnet_data.NUM_CLASSES)
        # The example's L2 decay is build_model's default, not an option: read it from there.
        decay = inspect.signature(build_fluid_resnet).parameters["weight_decay"].default
        return model, torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=decay)
    if name == "transformer":
        model = Transformer(transformer_data.VOCAB_SIZE, transformer_data.SEQ_LEN, transformer_data.NUM_CLASSES,
                            args.d_model, args.heads, args.layers, args.d_ff, args.dropout)
        return model, torch.optim.Adam(model.parameters(), lr=args.lr)
    raise ValueError(f"no torch twin of the example {name!r}: expected one of {', '.join(MODELS)}")


def to_tensors(name: str, feed: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, labels [N])`` of an example's feed dict (``image``/``tokens`` and ``label`` [N, 1])."""
    x = feed["image" if name == "resnet" else "tokens"]
    return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(feed["label"][:, 0]))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One step: forward, mean softmax cross entropy, backward (DDP allreduces here), optimizer update."""
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def parameter_shapes(model: nn.Module) -> list[tuple[int, ...]]:
    """The shapes of ``model``'s trainable parameters, each with its axes sorted, sorted (to compare with
    the example's: a torch ``Linear`` weight is the transpose of a Fluid ``fc`` weight)."""
    return sorted(tuple(sorted(p.shape)) for p in model.parameters() if p.requires_grad)
