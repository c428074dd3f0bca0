"""Public building blocks shared by the op families: input checks, varlen bookkeeping, chunk
packing, scores, dtypes, fla tables (docs/architecture.md)."""
