"""``python scripts/export_hf.py ...``: ``python -m torchtitan_cp.export_hf ...`` under its
older name (the same options, messages and exit status)."""

import sys

from torchtitan_cp.export_hf import main

if __name__ == "__main__":
    sys.exit(main())
