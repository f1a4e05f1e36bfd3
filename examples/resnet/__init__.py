"""The ResNet example: a small CIFAR-style residual network on generated 3x32x32 images (a collective
benchmark model: conv2d, batch_norm, pool2d, residual adds)."""
