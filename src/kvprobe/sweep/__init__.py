"""Layouts and distances as an experimental axis: ``kvprobe sweep`` (grid, measurement, summary)."""
