"""``python -m amped compare``: the same command line as the ``amped`` script."""

import sys

from amped.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
