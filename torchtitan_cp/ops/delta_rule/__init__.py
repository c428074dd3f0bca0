"""The gated delta rule (KDA, GDN): local kernels (torch, fla), custom ops and its
``Recurrence``."""
