"""Context parallelism for every op family: the ``Recurrence`` protocol and registry, the one
recurrence driver, and the differentiable collectives (docs/cp.md)."""
