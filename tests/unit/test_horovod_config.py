"""horovodrun's YAML --config-file, read without a YAML library (elasticrun/driver/cli/horovod_config.py)."""

from __future__ import annotations

import pytest

from elasticrun.driver.cli.horovod_config import parse_yaml_sections, to_options

pytestmark = pytest.mark.timeout(30)

HOROVOD_EXAMPLE = """\
# the sections horovodrun documents
controller: gloo

params:
  fusion_threshold_mb: 32
  cycle_time_ms: 10
  cache_capacity: 2048
  hierarchical_allreduce: true
  hierarchical_allgather: false

autotune:
  enabled: true
  log_file: 'horovod_autotune_log.txt'
  warmup_samples: 5
  gaussian_process_noise: 0.9

timeline:
  filename: "horovod_timeline.json"   # rank 0 writes it
  mark_cycles: yes

stall_check:
  enabled: false
  warning_time_seconds: 120

library_options:
  mpi_threads_disable: true
  num_nccl_streams: 2
  ccl_bgt_affinity: 1
  gloo_timeout_seconds: 60

logging:
  level: info
  with_timestamp: ~
"""


def test_horovods_documented_file():
    parsed = parse_yaml_sections(HOROVOD_EXAMPLE)
    assert parsed["controller"] == "gloo" and parsed["params"]["cycle_time_ms"] == 10
    assert parsed["autotune"]["gaussian_process_noise"] == 0.9 and parsed["logging"]["with_timestamp"] is None
    assert to_options(parsed) == {
        "gloo": True, "fusion-threshold-mb": 32, "cycle-time-ms": 10, "cache-capacity": 2048,
        "hierarchical-allreduce": True, "hierarchical-allgather": False, "autotune": True,
        "autotune-log-file": "horovod_autotune_log.txt", "autotune-warmup-samples": 5,
        "autotune-gaussian-process-noise": 0.9, "timeline-filename": "horovod_timeline.json",
        "timeline-mark-cycles": True, "no-stall-check": True, "stall-check-warning-time-seconds": 120,
        "mpi-threads-disable": True, "num-nccl-streams": 2, "ccl-bgt-affinity": 1, "gloo-timeout-seconds": 60,
        "log-level": "INFO"}


@pytest.mark.parametrize("text,error", [
    ("params:\n  - 1\n", "line 2: '- 1' is not `key: value`"),
    ("params:\n  a:\n    b: 1\n", "line 2: only one level of sections"),
    ("params:\n  a: 1\n   b: 2\n", "line 3: only one level of sections"),
    ("  a: 1\n", "line 1: indented, but not under a section"),
    ("params: {a: 1}\n", "line 1: '{a: 1}': only plain values"),
    ("timeline:\n  filename: 'x\n", "line 2: unterminated string"),
    ("params:\n  a: 1\n  a: 2\n", "line 3: 'a' appears twice in its section"),
    ("params:\n\ta: 1\n", "line 2: a tab in the indentation"),
    ("just text\n", "line 1: 'just text' is not `key: value`"),
])
def test_anything_else_names_its_line(text, error):
    with pytest.raises(ValueError) as exc:
        parse_yaml_sections(text)
    assert str(exc.value).startswith(error), exc.value


@pytest.mark.parametrize("config,error", [
    ({"controller": "nccl"}, "controller: 'nccl' is not gloo or mpi"),
    ({"params": {"tensor_fusion": 1}}, "params.tensor_fusion: unknown key"),
    ({"verbose": 2}, "verbose: unknown key"),
])
def test_keys_horovodrun_does_not_have(config, error):
    with pytest.raises(ValueError, match=error):
        to_options(config)


def test_stall_check_enabled_means_no_flag():
    assert to_options({"stall_check": {"enabled": True}}) == {"no-stall-check": False}
    assert to_options({"controller": "MPI"}) == {"mpi": True}  # refused later, as --mpi


# Horovod's own config.default.yaml (its repository's root), as shipped.
HOROVOD_DEFAULT = """\
controller: gloo

params:
  fusion_threshold_mb: 64
  cycle_time_ms: 5
  cache_capacity: 1024
  hierarchical_allreduce: false
  hierarchical_allgather: false

autotune:
  enabled: false
  log_file: 'horovod_autotune_log.txt'
  warmup_samples: 3
  cycles_per_sample: 10
  bayes_opt_max_samples: 20
  gaussian_process_noise: 0.8

timeline:
  enabled: false
  filename: 'horovod_timeline.json'
  mark_cycles: false

stall_check:
  enabled: true
  warning_time_seconds: 60
  shutdown_time_seconds: 0

library_options:
  mpi_threads_disabled: false
  num_nccl_streams: 1
  mlsl_bgt_affinity: 0
"""


def test_horovods_own_default_file_is_read_and_its_disabled_timeline_stays_off():
    options = to_options(parse_yaml_sections(HOROVOD_DEFAULT))
    assert "timeline-filename" not in options and options["timeline-mark-cycles"] is False
    assert options["autotune"] is False and options["num-nccl-streams"] == 1
    enabled = to_options({"timeline": {"enabled": True, "filename": "t.json"}})
    assert enabled == {"timeline-filename": "t.json"}
