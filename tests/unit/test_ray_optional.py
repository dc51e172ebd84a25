"""Ray is an optional extra: without it ``--ray-address`` is one line saying what to install,
and nothing imports ray unless ``--ray-address`` is used (checked in fresh interpreters, with
ray made unimportable, so this holds whether or not ray is installed here)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)

# sys.modules["ray"] = None makes both ``import ray`` and importlib.util.find_spec("ray") see
# no ray, as in an environment without the extra.
WITHOUT_RAY = "import sys\nsys.modules['ray'] = None\n"


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=50)


def test_ray_address_without_ray_is_one_line_naming_the_extra():
    r = _python(WITHOUT_RAY + textwrap.dedent("""
        from elasticrun.driver.cli.command import main
        main(["--ray-address", "auto", "-np", "2", "python", "-c", "pass"])
    """))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "--ray-address needs ray" in lines[0] and "pip install 'ray==2.60.0' 'pynacl>=1.5'" in lines[0]


def test_elasticrun_run_with_ray_address_without_ray_raises_naming_the_extra():
    r = _python(WITHOUT_RAY + textwrap.dedent("""
        import elasticrun
        try:
            elasticrun.run(print, np=1, ray_address="auto")
        except ValueError as exc:
            print(exc)
    """))
    assert "pip install 'ray==2.60.0' 'pynacl>=1.5'" in r.stdout, r.stdout + r.stderr


def test_check_with_ray_address_without_ray_fails_that_line():
    r = _python(WITHOUT_RAY + textwrap.dedent("""
        from elasticrun.driver.cli.command import main
        raise SystemExit(main(["--check", "--ray-address", "auto"]))
    """))
    assert "FAIL  ray: not installed (pip install 'ray==2.60.0' 'pynacl>=1.5')" in r.stdout, r.stdout + r.stderr


def test_a_directory_named_ray_is_no_installation(tmp_path):
    """Ray's temporary directory is /tmp/ray: run from /tmp, it would look like a package."""
    (tmp_path / "ray").mkdir()
    r = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, '.'); sys.modules.pop('ray', None)\n"
                        "from elasticrun.discovery.ray_nodes import ray_missing\n"
                        "import importlib.util\n"
                        "spec = importlib.util.find_spec('ray')\n"
                        "print('ray' in ray_missing() if spec.origin is None else 'installed')"],
                       capture_output=True, text=True, timeout=50, cwd=tmp_path)
    assert r.stdout.strip() in ("True", "installed"), r.stderr


def test_the_driver_imports_neither_ray_nor_torch_without_ray_address():
    r = _python("""
        import sys
        from elasticrun.driver.cli.command import parse_settings
        from elasticrun.driver import driver  # noqa: F401
        from elasticrun.driver.cli import check  # noqa: F401
        from elasticrun.driver.launch import launchers  # noqa: F401
        s = parse_settings(["-np", "2", "--min-np", "1", "python", "-c", "pass"])
        assert s.ray_address is None
        print(sorted(m for m in ("ray", "torch", "nacl") if m in sys.modules))
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_ray_address_from_the_flag_the_config_file_and_the_environment(tmp_path, monkeypatch):
    from elasticrun.discovery.ray_nodes import ray_missing
    from elasticrun.driver.cli.command import parse_settings

    if ray_missing():
        pytest.skip("ray is not installed: pip install 'ray==2.60.0' 'pynacl>=1.5'")
    cfg = tmp_path / "c.toml"
    cfg.write_text('ray-address = "auto"\nray-cpus-per-worker = 2\nray-gpus-per-worker = 0.5\n'
                   "ray-resources = '{\"trainer\": 1}'\n")
    s = parse_settings(["--config-file", str(cfg), "-np", "2", "python", "x.py"])
    assert (s.ray_address, s.ray_cpus_per_worker, s.ray_gpus_per_worker, s.ray_resources) == (
        "auto", 2.0, 0.5, {"trainer": 1.0})
    assert s.max_np is None  # elastic: every slot Ray has room for
    monkeypatch.setenv("ELASTICRUN_RAY_ADDRESS", "10.0.0.1:6379")
    assert parse_settings(["-np", "2", "python", "x.py"]).ray_address == "10.0.0.1:6379"
    assert parse_settings(["--ray-address", "auto", "-np", "2", "python", "x.py"]).ray_address == "auto"


def test_a_ray_client_address_is_refused_in_one_line():
    from elasticrun.discovery.ray_nodes import ray_missing
    from elasticrun.driver.cli.command import parse_settings

    if ray_missing():
        pytest.skip("ray is not installed: pip install 'ray==2.60.0' 'pynacl>=1.5'")
    with pytest.raises(SystemExit) as exc:
        parse_settings(["--ray-address", "ray://head:10001", "-np", "2", "python", "x.py"])
    assert exc.value.code == 2
