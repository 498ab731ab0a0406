"""User memory placed, edited and transplanted: ``kvprobe memory`` on the generated long-conversation
memory set (:mod:`kvprobe.datasets.memory`; docs/memory.md).

    df = run_memory(lm, n=40)                      # one row per question x arm
    summarize_memory(df); equivalence(df, margin=0.05)

:mod:`.runner` holds the arms (full recompute early and late, the edit repairs, the transplant) and
the summaries; the TOST is :func:`kvprobe.metrics.tost_paired`.
"""

from kvprobe.memory.runner import (COLUMNS, DEFAULT_MARGIN, DEFAULT_SEAMS, GROUPS, arms, equivalence, question_rows,
                                   run_memory, summarize_memory, user_states)

__all__ = ["COLUMNS", "DEFAULT_MARGIN", "DEFAULT_SEAMS", "GROUPS", "arms", "equivalence", "question_rows",
           "run_memory", "summarize_memory", "user_states"]
