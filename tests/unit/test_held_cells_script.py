"""scripts/held_cells.py's arithmetic: a cell's target work from two GetStats readings, and the
lines it prints from them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "held_cells.py"


@pytest.fixture(scope="module")
def held_cells():
    spec = importlib.util.spec_from_file_location("held_cells", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules["held_cells"] = module  # its dataclass looks its module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["held_cells"]


def test_a_cells_work_is_the_difference_of_two_readings_with_prefills_apart(held_cells) -> None:
    before = {0: (10, 2000.0), 16: (5, 400.0)}
    after = {0: (14, 3000.0), 16: (8, 640.0), 12: (2, 120.0)}
    work = held_cells.cell_work(before, after)
    assert (work.passes, work.prefills) == (5, 4)
    assert work.verify_ms == pytest.approx(360.0)
    assert work.prefill_ms == pytest.approx(1000.0)
    assert work.rows == pytest.approx((3 * 16 + 2 * 12) / 5)


def test_the_passes_line_gives_the_verify_time_per_token_streamed(held_cells) -> None:
    work = held_cells.CellWork(passes=4, rows=16.0, verify_ms=300.0, prefills=2, prefill_ms=500.0)
    line = held_cells.passes_line(work, wall_s=1.0, tokens=120)
    assert "verify passes 4, mean rows 16.0, mean 75.0 ms, in passes 30 % of the wall time, 2.50 ms a token" in line
    assert line.endswith("prefills 2, mean 250.0 ms, in prefills 50 %")
    assert held_cells.passes_line(held_cells.CellWork(0, 0.0, 0.0, 1, 80.0), 1.0, 0).startswith("no verify passes;")


def test_medians_are_set_against_the_first_configuration(held_cells) -> None:
    line = held_cells.medians_line({"0": [4.0, 5.0, 6.0], "2": [3.0, 4.0]}, "ms", 2)
    assert line == "medians: 0 5.00 ms (1.00x), 2 3.50 ms (0.70x)"
