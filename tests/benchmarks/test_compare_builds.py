"""benchmarks/compare_builds.py: the case labels name every size apart (no timing)."""

from __future__ import annotations

from benchmarks.compare_builds import _size_label


def test_size_labels_are_distinct_and_exact() -> None:
    sizes = [16 << 10, 64 << 10, 256 << 10, 1 << 20, 1536 << 10, 16 << 20]
    labels = [_size_label(s) for s in sizes]
    assert labels == ["16 KB", "64 KB", "256 KB", "1 MB", "1536 KB", "16 MB"]
    assert len(set(labels)) == len(sizes)
