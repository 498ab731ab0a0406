"""The confidence sequence of a calibration: :mod:`kvprobe.stopping.sequence` (its home, below the
field policy that re-checks its verdicts), under the name the calibration and its docs use."""

from kvprobe.stopping.sequence import (ALPHA_LOWER, ALPHA_UPPER, W0, Sequence, bounds_table,  # noqa: F401
                                       chain_alpha, chain_error, first_look, simulate_chain, simulate_coverage)
