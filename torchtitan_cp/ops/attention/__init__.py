"""Softmax attention under context parallelism: the sdpa all-gather op, pass-KV point-to-point
rounds and the flex document mask."""
