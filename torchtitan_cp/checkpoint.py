"""``python -m torchtitan_cp.checkpoint verify|seal STEP_DIR``: the checkpoint manifest CLI
(``torchtitan_cp.run.checkpoint``)."""

import sys

from torchtitan_cp.run.checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
