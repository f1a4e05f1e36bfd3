"""The Transformer example: a small Transformer-encoder classifier of generated token sequences (a
collective benchmark model: layer_norm, multi-head attention from matmul/softmax, gelu, dropout)."""
