"""The test suite's own helpers: bounds that stretch with the machine's load."""

from __future__ import annotations

import pytest

from tests import helpers


@pytest.mark.parametrize(
    ("load", "cpus", "stretch"), [(0.1, 2, 1.0), (2.0, 2, 1.0), (8.0, 2, 4.0), (100.0, 2, 6.0)]
)
def test_a_bound_stretches_with_the_load_per_core_between_one_and_six_times(
    monkeypatch: pytest.MonkeyPatch, load: float, cpus: int, stretch: float
) -> None:
    monkeypatch.setattr(helpers.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(helpers.os, "cpu_count", lambda: cpus)
    assert helpers.patience(30) == pytest.approx(30 * stretch)
