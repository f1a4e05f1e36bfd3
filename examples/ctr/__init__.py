"""The CTR example: a wide-and-deep click-through-rate model on Criteo-format data (as Paddle's dist_ctr)."""
