"""Token mixers, one module per family: delta net (KDA, GDN), Mamba2, softmax attention."""
