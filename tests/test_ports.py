"""Test servers take free ports: the suite passes while ``nmt serve --demo`` holds the default ones.

``tests/conftest.py`` holds the default addresses for the whole run (``pytest_configure``, in the controller
when pytest-xdist runs workers), so every server fixture and server process of the suite runs while they are
taken; these tests check that the hold is real and that the harness refuses a fixed port before it tries to
bind one.
"""

from __future__ import annotations

import errno
import socket

import pytest

from server.config import ServerConfig
from tests.harness import ServerHarness


def test_the_default_addresses_are_taken_while_the_suite_runs(default_ports_taken: list[str]) -> None:
    for address in default_ports_taken:
        host, _, port = address.rpartition(":")
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp and grpc bind
            with pytest.raises(OSError) as caught:
                sock.bind((host, int(port)))
            assert caught.value.errno == errno.EADDRINUSE, address


@pytest.mark.parametrize("field", ["listen", "metrics_listen", "http_listen"])
def test_the_harness_refuses_a_fixed_port(field: str, tmp_path) -> None:
    overrides = {"listen": "127.0.0.1:0", "metrics_listen": "", "http_listen": "", field: "127.0.0.1:8080"}
    config = ServerConfig(model_repository=str(tmp_path), provider="cpu", **overrides)
    with pytest.raises(ValueError, match=f"{field} is '127.0.0.1:8080'"):
        ServerHarness(config)
