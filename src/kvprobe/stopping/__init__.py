"""When a stream of pass/fail checks allows a verdict: the confidence sequence (``sequence``) and the
rule that turns counts into a repair per field (``rule``). Below the calibration that measures the
counts and the field policy that records them, so both apply one rule (kvprobe.field_policy.verify
recomputes every verdict of a policy file with it)."""
