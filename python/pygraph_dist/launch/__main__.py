"""``python -m pygraph_dist.launch``: the ``pygraph-launch`` command (:mod:`.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
