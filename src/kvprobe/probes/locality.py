"""Locality patching: where does the decision read the field from?

Start from the old prompt's cache, swap the new prompt's K/V in at a set of positions, re-read
the decision. Sets: nothing (recovers 0), everything (recovers 1), the field span, the whole
downstream span, the top-k downstream positions by single-position effect, random k downstream
positions (the control), each single position (the sweep), and the field and downstream spans
one layer at a time.

Recovery here is per case, ``(m - m_stale) / (m_oracle - m_stale)``; the guard against small
oracle flips is applied when aggregating (``m_stale``/``m_oracle`` ride along in every row).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
import torch

from kvprobe.datasets import AlignedCase
from kvprobe.kv.readout import answer_targets, logit_diff, option_columns, predicted
from kvprobe.probes.base import Inputs, ProbeStage, region_of, register, rows, run_each
from kvprobe.probes.concentration import concentration
from kvprobe.results import CONCENTRATION, LOCALITY
from kvprobe.probes.engine import PairCaches, Patch, patched_reads

TOP_KS = (1, 4, 8, 16, 32, 128)


def targets(a: AlignedCase) -> tuple[str, str]:
    """(new answer, old answer) options for m of an aligned case."""
    return answer_targets(a.case)


@dataclass(frozen=True)
class Locality:
    name = "locality"
    ks: tuple[int, ...] = TOP_KS
    n_random: int = 3  # random-k draws per k
    per_layer: bool = True
    seed: int = 0
    model_name: str = ""

    def sets(self, a: AlignedCase, effects: torch.Tensor | None) -> list[tuple[str, int | None, Patch]]:
        """The named patch sets for one case (after the sweep gave single-position effects)."""
        D, (f0, f1), (d0, d1) = a.decision_pos, a.field, a.downstream
        out = [("none", None, Patch(())), ("all", None, Patch(tuple(range(D)))),
               ("field", None, Patch(tuple(range(f0, f1)))), ("downstream", None, Patch(tuple(range(d0, d1))))]
        down = list(range(d0, d1))
        rng = random.Random(f"{self.seed}:{a.case.case_id}")
        for k in self.ks:
            if k > len(down):
                continue
            if effects is not None:
                order = sorted(down, key=lambda p: -float(effects[p]))
                out.append(("topk", k, Patch(tuple(sorted(order[:k])))))
            for _ in range(self.n_random):
                out.append(("randomk", k, Patch(tuple(sorted(rng.sample(down, k))))))
        return out

    def run(self, lm, pairs: Sequence[AlignedCase]) -> pd.DataFrame:
        return run_each(self, lm, pairs)

    def run_case(self, lm, a: AlignedCase, pc: PairCaches | None = None) -> pd.DataFrame:
        pc = pc or PairCaches.build(lm, a)
        new_ans, old_ans = targets(a)
        D = a.decision_pos
        m_of = lambda lg: logit_diff(lg, a.option_ids, new_ans, old_ans)  # noqa: E731
        cols = option_columns(a.option_ids)  # reads compute the options' logits only
        # clean reads: stale (nothing patched) and oracle (everything patched)
        ends = m_of(patched_reads(lm, pc, [Patch(()), Patch(tuple(range(D)))], columns=cols))
        m_stale, m_oracle = float(ends[0]), float(ends[1])
        flip = m_oracle - m_stale
        # the sweep: every single position, one batched read each
        sweep = m_of(patched_reads(lm, pc, [Patch((p,)) for p in range(D)], columns=cols))
        effects = sweep - m_stale  # (D,)
        records = [{"position": p, "region": region_of(a, p), "metric": "effect", "value": float(effects[p]),
                    "set": "single", "k": 1, "kind": a.kinds[p]} for p in range(D)]
        # named sets, plus field/downstream per layer
        named = self.sets(a, effects)
        if self.per_layer:
            n_layers = lm.adapter.n_layers
            for region, span in (("field", a.field), ("downstream", a.downstream)):
                named += [(f"{region}@layer", None, Patch(tuple(range(*span)), (layer,))) for layer in range(n_layers)]
        logits = patched_reads(lm, pc, [p for _, _, p in named], columns=cols)
        ms = m_of(logits)
        preds = predicted(logits, a.option_ids, a.case.options)
        oracle_pred = preds[1]
        for (name, k, patch), m, pred in zip(named, ms.tolist(), preds):
            layer = patch.layers[0] if patch.layers else None
            rec = (m - m_stale) / flip if flip else float("nan")
            agree = float(pred == oracle_pred)
            for metric, value in (("m", m), ("recovery", rec), ("agree", agree)):
                records.append({"layer": layer, "region": name.split("@")[0], "metric": metric, "value": value,
                                "set": name, "k": k})
        df = rows(self.model_name, a.case.case_id, self.name, records)
        df["m_stale"], df["m_oracle"], df["oracle_flip"] = m_stale, m_oracle, flip
        df["control"], df["n_positions"] = a.case.control, D
        return df


def _build(inputs: Inputs) -> Locality:
    return Locality(seed=inputs.seed, model_name=inputs.model_name)


STAGE = register(ProbeStage("locality", LOCALITY, _build, sections=("notes", "locality"),
                            derived=lambda table: {CONCENTRATION: concentration(table)}))
