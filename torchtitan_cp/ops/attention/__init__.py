"""Softmax attention under context parallelism: the sdpa all-gather op and the flex document
mask."""
