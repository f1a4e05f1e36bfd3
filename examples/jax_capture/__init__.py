"""Plain-JAX models captured as Flotilla Programs (``flotilla.jax``): an MLP, an embedding + pooling
CTR model and a 2-layer Transformer encoder, with their initial parameters and batch generators."""
