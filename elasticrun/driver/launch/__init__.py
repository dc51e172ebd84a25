"""Starting workers: child processes here, SSH to other hosts, warm-start templates, Ray.

The loop never imports this package: it is handed a ``Launcher`` (``driver/launching.py``).
"""
