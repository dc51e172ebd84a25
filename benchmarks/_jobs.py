"""Running a benchmark's measuring process (alone, or as the ranks of an elasticrun job) and
reading back the one JSON line it prints."""

from __future__ import annotations

import json
import subprocess
from typing import Any


def json_result(cmd: list[str], marker: str, timeout: float = 600) -> Any:
    """Run ``cmd`` and return the first stdout line that starts with ``marker`` (after
    elasticrun's ``[rank]<stdout>:`` prefix), parsed as JSON."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    for line in out.stdout.splitlines():
        text = line.split(">:", 1)[-1]
        if text.startswith(marker):
            return json.loads(text)
    raise RuntimeError(f"{' '.join(cmd[:6])}... printed no {marker!r} line (exit {out.returncode}):\n"
                       f"{out.stdout}\n{out.stderr}")
