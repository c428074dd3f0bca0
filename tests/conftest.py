"""The suite's shared pytest configuration.

* Markers: ``slow`` marks every test that starts a process (gloo ranks, torchrun, a subprocess);
  ``pytest -m "not slow"`` is the fast in-process loop. The plugin ``tests.process_starts``
  registers the marker and fails an unmarked test that starts a process.
* Shared helpers are imported one way, as ``tests.<module>`` (``tests`` is a package):
  ``tests.dist_utils`` (gloo ranks, layout cases), ``tests.launch`` (the real entry points),
  ``tests.helpers`` (batches, files), ``tests.reference`` / ``tests.reference_ssd`` (float64
  oracles).
"""

pytest_plugins = ["tests.process_starts"]
