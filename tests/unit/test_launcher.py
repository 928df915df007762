"""`start_stack`'s start-up order (specd/launcher.py), with fake processes: no services run."""

from __future__ import annotations

from pathlib import Path

import pytest

from specd import launcher


class FakeProcess:
    def __init__(self, exited: bool = False) -> None:
        self.returncode = 1 if exited else None

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.returncode = -sig

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode


@pytest.fixture
def launched(monkeypatch, tmp_path):
    """Records every launch and health wait. With `slow_target["on"]`, a coordinator launched
    while the target is not yet up gives up (as one whose 30 s wait for a target ran out)."""
    events: list[str] = []
    up: set[str] = set()
    slow_target = {"on": False}

    started: list[launcher.Service] = []

    def launch(service: str, args: list[str], log_dir: Path, metrics_port: int | None = None, port: int | None = None):
        events.append(f"launch {service}")
        gives_up = slow_target["on"] and service == "coordinator" and "target" not in up
        started.append(launcher.Service(service, len(events), FakeProcess(exited=gives_up), tmp_path / service))
        return started[-1]

    def healthy(address: str, timeout: float, tls=None) -> None:
        name = {s.address: s.name for s in started}[address]
        events.append(f"healthy {name}")
        up.add(name)

    monkeypatch.setattr(launcher, "launch_service", launch)
    monkeypatch.setattr(launcher, "wait_healthy", healthy)
    return events, started, slow_target


def test_the_coordinator_starts_once_the_draft_is_up_while_the_target_loads(launched, tmp_path):
    events, started, _ = launched
    stack = launcher.start_stack(tmp_path)
    assert events == ["launch target", "launch draft", "healthy draft", "launch coordinator", "healthy target",
                      "healthy coordinator"]
    assert (stack.target, stack.draft, stack.coordinator) == tuple(started)


def test_a_coordinator_that_gave_up_on_a_slow_target_is_launched_again(launched, tmp_path):
    events, started, slow_target = launched
    slow_target["on"] = True
    stack = launcher.start_stack(tmp_path)
    assert events == ["launch target", "launch draft", "healthy draft", "launch coordinator", "healthy target",
                      "launch coordinator", "healthy coordinator"]
    assert stack.coordinator is started[-1] and stack.coordinator.proc.poll() is None
