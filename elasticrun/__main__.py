"""``python -m elasticrun``: same as the ``elasticrun`` console script."""

import sys

from elasticrun.driver.cli import main

if __name__ == "__main__":
    sys.exit(main())
