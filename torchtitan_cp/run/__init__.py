"""Run safety: the dump folder's lock, the start of a run and its metrics history, verified
checkpoints, the loss-spike guard and their errors."""
