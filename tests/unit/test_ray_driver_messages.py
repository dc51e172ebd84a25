"""Ray's driver thread prints the cluster's messages (a raylet's death with its state dump)
to stderr past the ``ray`` logger: while elasticrun's own connection lasts they go to Ray's
log file with its other lines, and Ray's function is put back after."""

import logging

import pytest

pytest.importorskip("ray", reason="ray is not installed")

from ray._private import worker as ray_worker  # noqa: E402

from elasticrun.driver.launch import ray_launcher  # noqa: E402

pytestmark = pytest.mark.timeout(60)


class Caught(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class CaughtFile(ray_launcher.PrivateLog, Caught):
    """A PrivateLog (the file handler connect() adds) that keeps what it was given."""

    def __init__(self) -> None:
        Caught.__init__(self)

    def emit(self, record: logging.LogRecord) -> None:
        Caught.emit(self, record)


def test_raylet_messages_go_to_rays_log_while_connected(capsys):
    original = ray_worker.print_to_stdstream
    caught = CaughtFile()
    logging.getLogger("ray").addHandler(caught)
    try:
        ray_launcher._quiet_driver_messages(True)
        ray_worker.print_to_stdstream({"lines": ["Raylet is terminated."], "pid": "raylet", "is_err": False}, False)
        out = capsys.readouterr()
        assert out.out == "" and out.err == ""
        assert caught.lines == ["(raylet) Raylet is terminated."]
        ray_launcher._quiet_driver_messages(True)  # twice: still one layer
        ray_launcher._quiet_driver_messages(False)
        assert ray_worker.print_to_stdstream is original
    finally:
        ray_worker.print_to_stdstream = original
        logging.getLogger("ray").removeHandler(caught)


def test_an_address_where_nothing_listens_is_one_line_at_once_not_rays_minutes_of_retries():
    """Ray retries a GCS address where nothing answers for many minutes, printing its C++
    warnings meanwhile: elasticrun looked hung. A HOST:PORT that accepts no connection is
    refused first, in one line."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(ConnectionError) as exc:
        ray_launcher._probe(f"127.0.0.1:{port}")
    assert str(exc.value) == (f"--ray-address 127.0.0.1:{port}: cannot join a Ray cluster there: Connection refused "
                              f"(is the head node up? `ray start --head` prints its address)")
    for left_to_ray in ("auto", "local", "ray://head:10001", "head"):
        ray_launcher._probe(left_to_ray)


def test_a_callers_own_ray_connection_is_quieted_for_the_job_and_given_back(monkeypatch, capsys):
    """The Horovod pattern: the program called ray.init() itself, then elasticrun.run(). Ray's
    node messages reached the console (connect() returned before quieting them); now they go
    to Ray's log during the job either way, and the caller's connection is left open."""
    import ray

    original = ray_worker.print_to_stdstream
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    shut: list[bool] = []
    monkeypatch.setattr(ray, "shutdown", lambda: shut.append(True))
    try:
        assert ray_launcher.connect("127.0.0.1:1") is False  # (no probe either: already connected)
        ray_worker.print_to_stdstream({"lines": ["Raylet is terminated."], "pid": "raylet", "is_err": False}, False)
        assert capsys.readouterr().err == ""
        ray_launcher.disconnected(False)
        assert ray_worker.print_to_stdstream is original and shut == []  # theirs to shut down
    finally:
        ray_worker.print_to_stdstream = original
