"""The command line: flags, config files, horovodrun's options, ``--check``."""
