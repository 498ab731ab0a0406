"""``kvprobe calibrate``: a per-field repair policy for one template (docs/calibrate.md).

    from kvprobe.calibrate import calibrate
    cal = calibrate("toy-qwen2", "examples/calibrate-toy.yaml")   # a model or spec, a spec or its path
    cal.summary     # DataFrame: field x candidate, with intervals
    cal.policy      # what field_policy.yaml holds
"""

from kvprobe.calibrate.engine import Calibration, CalibrationSpec, calibrate, load_spec

__all__ = ["Calibration", "CalibrationSpec", "calibrate", "load_spec"]
