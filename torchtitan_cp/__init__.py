"""torchtitan-cp: hybrid KDA/GDN/attention language models trained with context parallelism.

Packages (lower never imports upper; tests/test_layering.py checks it): ``routing`` (torch
only) < ``ops`` (+ fla) < ``models`` (+ ``compat``, torchtitan) < ``trainer`` (+ ``data``,
``run``) < the entry points ``train`` and ``checkpoint``. See docs/architecture.md.
"""

__version__ = "0.1.0"
