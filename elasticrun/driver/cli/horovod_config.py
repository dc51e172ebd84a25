"""horovodrun's ``--config-file`` (YAML, in sections) read as elasticrun options.

A Horovod config file is a mapping of sections (``params``, ``autotune``, ``timeline``,
``stall_check``, ``library_options``, ``logging``) of scalars, plus ``controller``. This reads
exactly that shape without a YAML library (none is installed with elasticrun) and turns it
into the flat ``long-flag-name -> value`` form of elasticrun's TOML file, so both go through
the same checks (``config.read_config_file``). Anything else (lists, nesting deeper than a
section, flow syntax, anchors) is refused with its line number: such a file is not one
horovodrun wrote.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["parse_yaml_sections", "to_options"]

_KEY = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\s*:(?:\s+(.*?))?\s*$")

#: (section, key) -> elasticrun's long flag name (``controller``, the one top-level key, apart).
_OPTIONS: dict[tuple[str, str], str] = {
    ("params", "fusion_threshold_mb"): "fusion-threshold-mb",
    ("params", "cycle_time_ms"): "cycle-time-ms",
    ("params", "cache_capacity"): "cache-capacity",
    ("params", "hierarchical_allreduce"): "hierarchical-allreduce",
    ("params", "hierarchical_allgather"): "hierarchical-allgather",
    ("autotune", "enabled"): "autotune",
    ("autotune", "log_file"): "autotune-log-file",
    ("autotune", "warmup_samples"): "autotune-warmup-samples",
    ("autotune", "steps_per_sample"): "autotune-steps-per-sample",
    ("autotune", "bayes_opt_max_samples"): "autotune-bayes-opt-max-samples",
    ("autotune", "gaussian_process_noise"): "autotune-gaussian-process-noise",
    ("timeline", "filename"): "timeline-filename",
    ("timeline", "mark_cycles"): "timeline-mark-cycles",
    ("stall_check", "enabled"): "stall-check",  # false: --no-stall-check
    ("stall_check", "warning_time_seconds"): "stall-check-warning-time-seconds",
    ("stall_check", "shutdown_time_seconds"): "stall-check-shutdown-time-seconds",
    ("library_options", "mpi_threads_disable"): "mpi-threads-disable",
    ("library_options", "num_nccl_streams"): "num-nccl-streams",
    ("library_options", "ccl_bgt_affinity"): "ccl-bgt-affinity",
    ("library_options", "gloo_timeout_seconds"): "gloo-timeout-seconds",
    ("logging", "level"): "log-level",
    ("logging", "with_timestamp"): "log-with-timestamp",
    ("logging", "hide_timestamp"): "log-hide-timestamp",
}


#: Keys that Horovod's own files hold (its config.default.yaml) which configure nothing here, or
#: nothing horovodrun reads either: accepted and dropped (``timeline.enabled`` apart, below).
_DROPPED: frozenset[tuple[str, str]] = frozenset({
    ("autotune", "cycles_per_sample"), ("library_options", "mpi_threads_disabled"),
    ("library_options", "mlsl_bgt_affinity"),
})


def _scalar(text: str, line: int) -> Any:
    """A YAML scalar as horovodrun's files hold them: bool, number, null or string."""
    if text[:1] in "\"'":
        quote = text[0]
        if len(text) < 2 or not text.endswith(quote):
            raise ValueError(f"line {line}: unterminated string {text[:40]!r}")
        return text[1:-1]
    if text[:1] in "[{&*!|>" or text == "-" or text.startswith("- "):
        raise ValueError(f"line {line}: {text[:40]!r}: only plain values are understood here")
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("null", "~", ""):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_yaml_sections(text: str) -> dict[str, Any]:
    """``{key: scalar, section: {key: scalar}}`` from a horovodrun YAML config; ValueError
    naming the line for anything else."""
    out: dict[str, Any] = {}
    section: dict[str, Any] | None = None
    indent: int | None = None
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #")[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not line.strip() or line.strip() == "---":
            continue
        if "\t" in line[: len(line) - len(line.lstrip())]:
            raise ValueError(f"line {n}: a tab in the indentation")
        depth = len(line) - len(line.lstrip())
        m = _KEY.match(line.strip())
        if m is None:
            raise ValueError(f"line {n}: {line.strip()[:40]!r} is not `key: value`")
        key, value = m.group(1), m.group(2)
        if depth == 0:
            if key in out:
                raise ValueError(f"line {n}: {key!r} appears twice")
            if value is None:
                section, indent = {}, None
                out[key] = section
            else:
                section = None
                out[key] = _scalar(value, n)
            continue
        if section is None:
            raise ValueError(f"line {n}: indented, but not under a section")
        if indent is None:
            indent = depth
        if depth != indent or value is None:
            raise ValueError(f"line {n}: only one level of sections is understood here")
        if key in section:
            raise ValueError(f"line {n}: {key!r} appears twice in its section")
        section[key] = _scalar(value, n)
    return out


def to_options(config: dict[str, Any]) -> dict[str, Any]:
    """A parsed horovodrun config as elasticrun's file keys (long flag names) -> values;
    ValueError naming the key for one elasticrun has no counterpart of."""
    out: dict[str, Any] = {}
    for top, value in config.items():
        if top == "controller":
            if not isinstance(value, str) or value.lower() not in ("gloo", "mpi"):
                raise ValueError(f"controller: {value!r} is not gloo or mpi")
            out[value.lower()] = True  # mpi: refused later, with the --mpi message
            continue
        if not isinstance(value, dict):
            raise ValueError(f"{top}: unknown key (horovodrun's are controller and the sections params, "
                             f"autotune, timeline, stall_check, library_options, logging)")
        if top == "timeline" and value.get("enabled") is False:  # Horovod's default file: no timeline
            value = {k: v for k, v in value.items() if k not in ("enabled", "filename")}
        for key, item in value.items():
            if (top, key) in _DROPPED or (top, key) == ("timeline", "enabled"):
                continue
            name = _OPTIONS.get((top, key))
            if name is None:
                raise ValueError(f"{top}.{key}: unknown key")
            if item is None:
                continue
            if name == "stall-check":
                name, item = "no-stall-check", item is False
            if name == "log-level" and isinstance(item, str):
                item = item.upper()
            out[name] = item
    return out
