"""The services' garbage-collector settings (fleet_min.heap)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from fleet_min import heap


@pytest.fixture
def restored_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_start_up_objects_are_frozen_and_young_collections_spaced_out(restored_gc: None) -> None:
    survivor = [["made at start-up"]]  # a container the collector tracks (a dict of str is not)
    heap.settle_after_start()
    assert gc.get_freeze_count() > 1000  # the imports' objects, at least
    assert all(obj is not survivor for obj in gc.get_objects())  # never scanned again
    assert gc.get_threshold()[0] == heap.YOUNG_THRESHOLD


def test_cycles_made_after_settling_are_still_collected(restored_gc: None) -> None:
    heap.settle_after_start()

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # type: ignore[attr-defined]
    del a, b
    assert gc.collect() >= 2
