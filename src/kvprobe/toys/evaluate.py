"""Held-out evaluation of a toy: what it is for (deciding by the field, following an erratum,
ignoring control fields), each with its threshold."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch

from kvprobe.datasets import SHORT_ERRATUM, erratum_text, generate, render_prompt
from kvprobe.datasets.spans import option_ids
from kvprobe.kv.readout import predicted
from kvprobe.toys.examples import ToyData, unseen_cases, with_control_line, without_control_line

EVAL_SEED = 10_001
OPTIONS = ("yes", "no")


def _batch(ids: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids and mask (B, T), and each row's last real index (B,).

    Right padding keeps every real token at its unpadded position 0..L-1, and causal attention
    keeps pads out of real tokens' view, so the decision logits equal an unpadded prefill's.
    """
    width = max(len(x) for x in ids)
    input_ids = torch.zeros(len(ids), width, dtype=torch.long)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = 1
    return input_ids, mask, torch.tensor([len(x) - 1 for x in ids])


def decision_logits(model, ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """Logits (B, V) at each prompt's last token, from one right-padded batch."""
    input_ids, mask, last = _batch(ids)
    out = model(input_ids=input_ids, attention_mask=mask, logits_to_keep=last[:, None], use_cache=False)
    return out.logits[:, 0]  # (B, 1, V) -> (B, V)


@torch.no_grad()
def predict(model, tokenizer, texts: Sequence[str], batch_size: int = 16) -> list[str]:
    """The arg-max option (yes/no) for each raw prompt, batched by length; a text given more than
    once is computed once (evaluate_toy's control-line pairs repeat its decision prompts).

    16 prompts a batch: on one thread the six shipped toys' held-out evaluations took 67.2 s against
    91.6 s at 64 (Zen 4, the same figures to the last digit), where each batch's attention weights
    (batch x heads x length^2, float32) no longer fit the caches."""
    opt_ids = {o: option_ids(tokenizer, o) for o in OPTIONS}
    unique = list(dict.fromkeys(texts))
    ids = tokenizer(unique, add_special_tokens=False)["input_ids"]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    preds: list[str] = [""] * len(ids)
    for lo in range(0, len(order), batch_size):
        chunk = order[lo : lo + batch_size]
        for i, pred in zip(chunk, predicted(decision_logits(model, [ids[i] for i in chunk]), opt_ids, list(OPTIONS))):
            preds[i] = pred
    of = dict(zip(unique, preds))
    return [of[t] for t in texts]


METRICS = {
    "acc_old": "accuracy, old value",
    "acc_new": "accuracy, new value",
    "acc_erratum": "accuracy, old value + erratum (paper template) to the new",
    "acc_erratum_short": "accuracy, old value + short erratum to the new",
    "inv_control_value": "control value changed: answer unchanged",
    "inv_control_added": "control line added: answer unchanged",
    "inv_control_removed": "control line removed: answer unchanged",
    "acc_long": "accuracy (old and new) with more fillers than in training",
    "acc_unseen": "accuracy (old and new), two unseen domains (chance ~0.5)",
}
# What a toy is for, each on at least 90% of held-out prompts: deciding by the field, following an
# erratum, ignoring control fields. A run probes only the cases a model gets right under both
# values, so a toy's errors cost cases, never correctness: 0.90 per value keeps at least ~80% of
# cases valid. The earlier 0.98 sat within one or two prompts of what the recipe reaches, so a
# retrain on another CPU type failed it by chance (0.967 on an Intel machine). A recipe has room
# to spare where every seed clears every threshold by MARGIN (6 of the 300 decision prompts);
# docs/toys.md has the seeds.
THRESHOLDS = {"acc_old": 0.90, "acc_new": 0.90, "acc_erratum": 0.90, "acc_erratum_short": 0.90,
              "inv_control_value": 0.90, "inv_control_added": 0.90, "inv_control_removed": 0.90}
MARGIN = 0.02


def evaluate_toy(model, tokenizer=None, *, seed: int = EVAL_SEED, n: int = 400, n_unseen: int = 100,
                 fillers: tuple[int, int] = (0, 9), train_max_fillers: int = ToyData().fillers[1],
                 controls: float = 0.25) -> dict[str, float]:
    """Held-out figures (see :data:`METRICS`) on fresh cases; ``model`` may be a ``LoadedModel``.

    Decision cases: accuracy under the old value, the new value, and the old value with an
    erratum (either template) announcing the new one. Invariance: the share of prompts whose
    answer is unchanged when a control value changes (generator controls), when an absent control
    line is added, or when a present one is removed (decision cases, under both values).
    """
    if tokenizer is None:
        model, tokenizer = model.model, model.tokenizer
    model.eval()
    rng = random.Random(seed)
    cases = generate(n, seed=seed, controls=controls, fillers=fillers)
    dec = [c for c in cases if not c.control]
    ctl = [c for c in cases if c.control]
    # Added / removed control lines: the same prompt with and without the change, both values.
    pairs_added, pairs_removed = [], []
    for c in dec:
        plus = with_control_line(rng, c)
        minus = without_control_line(rng, c)
        for v in (c.old_value, c.new_value):
            base = render_prompt(c, None, v, "raw")
            if plus is not c:
                pairs_added.append((base, render_prompt(plus, None, v, "raw")))
            if minus is not None:
                pairs_removed.append((base, render_prompt(minus, None, v, "raw")))
    unseen = unseen_cases(n_unseen, seed, fillers)

    prompts: list[tuple[str, str]] = []  # (group, text)
    def add(group, texts):  # noqa: E306
        prompts.extend((group, t) for t in texts)

    add("old", [render_prompt(c, None, c.old_value, "raw") for c in dec])
    add("new", [render_prompt(c, None, c.new_value, "raw") for c in dec])
    add("erratum", [render_prompt(c, None, c.old_value, "raw", erratum=erratum_text(c.field, c.new_value)) for c in dec])
    add("erratum_short", [render_prompt(c, None, c.old_value, "raw",
                                        erratum=erratum_text(c.field, c.new_value, SHORT_ERRATUM)) for c in dec])
    add("ctl_old", [render_prompt(c, None, c.old_value, "raw") for c in ctl])
    add("ctl_new", [render_prompt(c, None, c.new_value, "raw") for c in ctl])
    add("added_a", [a for a, _ in pairs_added])
    add("added_b", [b for _, b in pairs_added])
    add("removed_a", [a for a, _ in pairs_removed])
    add("removed_b", [b for _, b in pairs_removed])
    add("unseen_old", [render_prompt(c, None, c.old_value, "raw") for c in unseen])
    add("unseen_new", [render_prompt(c, None, c.new_value, "raw") for c in unseen])

    preds = predict(model, tokenizer, [t for _, t in prompts])
    got: dict[str, list[str]] = {}
    for (group, _), p in zip(prompts, preds):
        got.setdefault(group, []).append(p)

    def acc(pred: list[str], want: list[str]) -> float:  # NaN when there is nothing to count
        return sum(p == w for p, w in zip(pred, want)) / len(want) if want else math.nan

    def same(a: list[str], b: list[str]) -> float:
        return sum(x == y for x, y in zip(a, b)) / len(a) if a else math.nan

    long = [i for i, c in enumerate(dec) if len(c.fillers) > train_max_fillers]
    return {
        "acc_old": acc(got["old"], [c.expected_old for c in dec]),
        "acc_new": acc(got["new"], [c.expected_new for c in dec]),
        "acc_erratum": acc(got["erratum"], [c.expected_new for c in dec]),
        "acc_erratum_short": acc(got["erratum_short"], [c.expected_new for c in dec]),
        "inv_control_value": same(got.get("ctl_old", []), got.get("ctl_new", [])),
        "inv_control_added": same(got.get("added_a", []), got.get("added_b", [])),
        "inv_control_removed": same(got.get("removed_a", []), got.get("removed_b", [])),
        "acc_long": acc([got["old"][i] for i in long] + [got["new"][i] for i in long],
                        [dec[i].expected_old for i in long] + [dec[i].expected_new for i in long]),
        "acc_unseen": acc(got["unseen_old"] + got["unseen_new"],
                          [c.expected_old for c in unseen] + [c.expected_new for c in unseen]),
        "n_decision": len(dec), "n_control": len(ctl), "n_added": len(pairs_added),
        "n_removed": len(pairs_removed), "n_long": len(long), "n_unseen": len(unseen),
    }


def threshold_failures(metrics: dict[str, float]) -> list[str]:
    """The :data:`THRESHOLDS` a metrics dict misses, as ``"name 0.93 < 0.95"`` strings."""
    return [f"{k} {metrics[k]:.3f} < {v}" for k, v in THRESHOLDS.items() if not metrics[k] >= v]  # NaN fails


def compare_heldout(retrained: dict, shipped: dict) -> list[tuple[str, float, float, float]]:
    """Rows (metric, retrained, shipped, difference) over :data:`METRICS` present in both."""
    return [(k, retrained[k], shipped[k], retrained[k] - shipped[k]) for k in METRICS
            if k in retrained and k in shipped]
