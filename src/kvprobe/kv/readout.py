"""Reading a decision out of logits: option scores and the answer logit difference.

An option (e.g. "yes") maps to several first-token ids (with and without a leading space, see
:mod:`kvprobe.datasets.spans`); its score is the max logit over those ids. The decision metric
``m`` of the paper is ``score(new answer) - score(old answer)``.
"""

from __future__ import annotations

import torch

from kvprobe.errors import KvprobeError


def option_scores(logits: torch.Tensor, option_ids: dict[str, list[int]], options: list[str]) -> torch.Tensor:
    """(..., V) logits -> (..., n_options) scores, in the order of ``options``."""
    cols = [logits[..., torch.as_tensor(option_ids[o], device=logits.device)].max(-1).values for o in options]
    return torch.stack(cols, -1)


def option_columns(option_ids: dict[str, list[int]]) -> list[int]:
    """Every vocabulary id an option's score reads (the columns a decision read needs)."""
    return sorted({i for ids in option_ids.values() for i in ids})


def logit_diff(logits: torch.Tensor, option_ids: dict[str, list[int]], answer_new: str, answer_old: str) -> torch.Tensor:
    """m = score(answer_new) - score(answer_old), shape (...)."""
    s = option_scores(logits, option_ids, [answer_new, answer_old])
    return s[..., 0] - s[..., 1]


def predicted(logits: torch.Tensor, option_ids: dict[str, list[int]], options: list[str]) -> list[str]:
    """The arg-max option for each leading index of (..., V) logits, flattened."""
    idx = option_scores(logits, option_ids, options).reshape(-1, len(options)).argmax(-1)
    return [options[i] for i in idx.tolist()]


def answer_targets(case) -> tuple[str, str]:
    """(new-answer option, old-answer option) for m; a control keeps its answer, so its m is
    measured against the other option. A case without expected answers has no m."""
    if case.expected_old is None or case.expected_new is None:
        raise KvprobeError(f"case {case.case_id} has no expected answers (expected_old, expected_new); the "
                           f"decision metric m needs them")
    if case.control:
        return next(o for o in case.options if o != case.expected_old), case.expected_old
    return case.expected_new, case.expected_old


def valid_case(case, pred_old: str, pred_new: str) -> bool:
    """Whether a case is valid: the decision read under the old value (the stale read) is
    ``expected_old`` and under the new value (the oracle read) ``expected_new``. A decision case
    is then one whose answer the edit flips; a negative control, one whose answer it leaves alone."""
    return pred_old == case.expected_old and pred_new == case.expected_new
