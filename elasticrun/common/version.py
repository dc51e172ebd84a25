"""elasticrun's version, in one place (the package, ``--version`` and ``--check`` read it)."""

VERSION = "0.1.0"
