"""scripts/slot_effects.py: parsing bench-load's run lines and fitting the slots' effect."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from coordinator.bench_load import cell_order

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "slot_effects.py"
CONFIGS = ["off", "k2", "k4", "auto"]


@pytest.fixture(scope="module")
def slot_effects():
    spec = importlib.util.spec_from_file_location("slot_effects", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_run_lines_parse_into_cells(slot_effects) -> None:
    lines = ["starting the stack\n", "run 1: chat       c16  off 92.5 | k2 80.8 | k4 74.9 | auto 85.7 (k 0.0)\n",
             "run 2: code_edit  c1   off 16.2 | k2 28.2 | k4 32.2 | auto 36.5 (k 4.4)\n"]
    cells = slot_effects.parse_cells(lines, first_run=3)
    assert cells[("chat", 16, 3, "auto")] == 85.7
    assert cells[("code_edit", 1, 4, "k4")] == 32.2
    assert len(cells) == 8


def test_the_fit_recovers_slot_and_configuration_effects_in_a_williams_square(slot_effects) -> None:
    """Cells made of a machine term per kind and run, a configuration term and a slot term: the
    fit gives back the slot factors and auto's ratio to off."""
    slot_factor = [1.06, 0.98, 1.0, 0.96]
    config_factor = {"off": 1.0, "k2": 0.9, "k4": 0.85, "auto": 0.97}
    machine = {("chat", 0): 90.0, ("chat", 1): 100.0, ("chat", 2): 85.0, ("chat", 3): 95.0,
               ("code", 0): 70.0, ("code", 1): 72.0, ("code", 2): 80.0, ("code", 3): 75.0}
    cells = {}
    for (kind, run), base in machine.items():
        order = [n for n, _ in cell_order([(n, n) for n in CONFIGS], run)]
        for name in CONFIGS:
            cells[(kind, 16, run, name)] = base * config_factor[name] * slot_factor[order.index(name)]
    slots, config = slot_effects.fit_slots(cells, CONFIGS)
    mean = math.exp(sum(math.log(f) for f in slot_factor) / len(slot_factor))
    assert slots == pytest.approx([f / mean for f in slot_factor], rel=1e-3)
    assert config[("chat", 16, "auto")] / config[("chat", 16, "off")] == pytest.approx(0.97, rel=1e-3)
