"""torchrun's variables are checked before use: a malformed one is a ConfigError naming it, and a
MASTER_PORT another process holds is one ProbeError naming the address, not torch's DistNetworkError."""

import socket

import pytest

pytest.importorskip("torch")

from memcalc.errors import ConfigError, ProbeError  # noqa: E402
from memcalc.probe.launch import run, run_torchrun, torchrun_env, under_torchrun  # noqa: E402

GOOD = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def _whoami(tp) -> tuple:
    return tp.rank, tp.size


def _set(monkeypatch, **changes: str) -> None:
    for name, value in (GOOD | changes).items():
        monkeypatch.setenv(name, value)


def test_well_formed_variables_are_read_as_numbers(monkeypatch):
    _set(monkeypatch, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")
    assert torchrun_env() == {"RANK": 1, "WORLD_SIZE": 2, "LOCAL_RANK": 1, "MASTER_PORT": 29500}


@pytest.mark.parametrize("changes, message", [
    ({"RANK": "zero"}, "RANK='zero' is not a whole number >= 0"),
    ({"RANK": "-1"}, "RANK='-1' is not a whole number >= 0"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' is not a whole number >= 1"),
    ({"LOCAL_RANK": ""}, "LOCAL_RANK='' is not a whole number >= 0"),
    ({"MASTER_PORT": "http"}, "MASTER_PORT='http' is not a whole number >= 1"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a port (1 to 65535)"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
    ({"RANK": "9" * 5000}, "RANK='9999.*9999' is not a whole number >= 0"),
])
def test_a_malformed_variable_is_named_wherever_it_is_first_read(monkeypatch, changes, message):
    _set(monkeypatch, **changes)
    for use in (under_torchrun, lambda: run(_whoami, mode="torchrun", t=1), lambda: run_torchrun(_whoami)):
        pattern = f"torchrun variable {message}".replace("(", r"\(").replace(")", r"\)")
        with pytest.raises(ConfigError, match=pattern) as caught:
            use()
        assert len(str(caught.value)) < 250


def test_a_busy_master_port_is_one_line_naming_the_address(monkeypatch):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        _set(monkeypatch, MASTER_PORT=str(port))
        with pytest.raises(ProbeError) as caught:
            run_torchrun(_whoami, timeout_s=10)
    message = str(caught.value)
    where = f"MASTER_ADDR='127.0.0.1' MASTER_PORT={port}"
    assert message.startswith(f"torchrun rank 0 could not meet the others at {where}:")
    assert "\n" not in message and "EADDRINUSE" in message
