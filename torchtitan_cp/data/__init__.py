"""Data: the bundled corpus and JSONL datasets on torchtitan's loader, dataset checks, and the
host copy of every batch's positions."""
