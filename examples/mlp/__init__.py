"""The MLP example: a softmax classifier over Gaussian clusters."""
