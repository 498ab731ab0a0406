"""The confidence sequence of a calibration: :mod:`kvprobe.stopping.sequence` (its home, below the
field policy that re-checks its verdicts), under the name the calibration and its docs use."""

from kvprobe.stopping.sequence import (ALPHA_LOWER, ALPHA_UPPER, W0, Sequence, bounds_table,  # noqa: F401
                                       first_look, simulate_coverage)
