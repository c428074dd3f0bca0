"""torchtitan-cp: hybrid KDA/GDN/attention language models trained with context parallelism.

Layers (lower never imports upper): ``routing`` (torch only) < ``ops`` (+ fla) < ``models``
(+ torchtitan) < ``data``, ``sequence``, ``trainer``, ``train``. See docs/architecture.md.
"""

__version__ = "0.1.0"
