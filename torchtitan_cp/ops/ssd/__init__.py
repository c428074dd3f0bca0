"""SSD, the recurrence of Mamba2 layers: local kernels (torch, fla) and its ``Recurrence``."""
