"""HTML reports: a pure function of results folders (see :mod:`kvprobe.reports.html`).

Nothing in the probes or the KV layer imports this package; the pipeline only calls
:func:`kvprobe.datasets.tokens.case_tokens` to store prompt tokens beside the results.
"""
