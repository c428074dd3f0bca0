"""The hybrid decoder: its blocks, the layer registry, flavors and parallelize."""
