"""``kvprobe memory`` folders in the report and summary.json: the "User memory" section and the ``memory``
fact, both recomputed from memory.parquet (never the manifest's stored summary), on a hand-made table
of the runner's shape (kvprobe.memory.COLUMNS and arms), with and without the policy arm's ``repair``."""

from __future__ import annotations

import html as html_lib
import json
import re

import jsonschema
import numpy as np
import pandas as pd
import pytest

from kvprobe.errors import KvprobeError
from kvprobe.memory import COLUMNS, arms, equivalence, summarize_memory
from kvprobe.reports.folder import load_run
from kvprobe.reports.html import render_html
from kvprobe.reports.summary import schema, summarize_run
from kvprobe.reports.stats import Stat
from kvprobe.results import MEMORY, MEMORY_MANIFEST, atomic_write_parquet
from tests.reports.test_render import columns, sections
from tests.unit.test_outputs import check_json

SEAMS = (0, 4)
POLICY = {"city": "field_only", "team": "erratum"}  # the repair per edited fact
ACCURACY = {"early": 0.8, "late": 0.7, "stale": 0.3, "oracle": 0.9, "erratum": 0.8, "neutral": 0.4, "field_only": 0.6,
            "transplant_full": 0.75, "transplant_seam0": 0.7, "transplant_seam4": 0.75}
CONTEXT = 300
RECOMPUTED = {"early": 300, "late": 300, "stale": 0, "oracle": 300, "erratum": 14, "neutral": 14, "field_only": 2,
              "transplant_full": 300, "transplant_seam0": 120, "transplant_seam4": 124}
TAIL = 10  # the question's tokens


def memory_table(users: int = 6, policy: bool = True, seed: int = 0) -> pd.DataFrame:
    """One row per question x arm as kvprobe.memory.question_rows writes them: three questions a user (the
    edited fact, another fact, a negative), answers drawn per arm at ACCURACY, the columns derived as the
    runner derives them; field_only fails for the last user (a value of another token length)."""
    rng = np.random.default_rng(seed)
    rows = []
    for u in range(users):
        edit_key = "city" if u % 2 == 0 else "team"
        for kind in ("edited", "other", "negative"):
            qid = f"mem-s0-{3 * u:05d}-{kind}"
            fact = {"edited": edit_key, "other": "pet", "negative": ""}[kind]
            old, new = ("", "") if kind == "negative" else ("A", "B" if kind == "edited" else "A")
            got = {}
            for group, arm in arms(SEAMS, policy):
                if arm == "policy":
                    chosen = POLICY[edit_key]
                    got[arm] = {**got[chosen], "arm": arm, "repair": chosen}
                    continue
                expected = new if group == "edit" else old
                failed = arm == "field_only" and u == users - 1
                answer = "" if failed else (
                    (expected if rng.random() < ACCURACY[arm] else {"A": "B", "B": "A"}[expected]) if expected
                    else str(rng.choice(["A", "B"])))
                tokens = float("nan") if failed else float(RECOMPUTED[arm] + TAIL)
                got[arm] = {"model": "toy-qwen2", "question_id": qid, "user_id": f"u{u}", "kind": kind, "fact": fact,
                            "group": group, "arm": arm, "repair": None, "layout": "early" if arm == "early" else "late",
                            "answer": answer, "margin": float("nan") if failed else float(rng.normal(1, 0.5)),
                            "expected": expected, "context_tokens": CONTEXT + TAIL, "tokens_recomputed": tokens,
                            "wall_s": float("nan") if failed else 0.001 * RECOMPUTED[arm],
                            "decide_s": float("nan") if failed else 0.002,
                            "setup_s": 0.05 if arm.startswith("transplant_seam") else float("nan"),
                            "error": "the new value takes +1 token(s): field-only replaces tokens one for one"
                            if failed else None}
            ref = {"edit": got["oracle"]["answer"], "transplant": got["transplant_full"]["answer"]}
            for r in got.values():
                r["frac_recomputed"] = r["tokens_recomputed"] / r["context_tokens"]
                r["correct"] = float(r["answer"] == r["expected"]) if r["expected"] and r["answer"] else float("nan")
                r["reference"] = ref.get(r["group"], "")
                r["agree"] = float(r["answer"] == r["reference"]) if r["reference"] and r["answer"] else float("nan")
                r["changed"] = (float(r["answer"] != got["late"]["answer"]) if r["group"] == "edit" and r["answer"]
                                else float("nan"))
            rows += got.values()
    return pd.DataFrame(rows, columns=list(COLUMNS))


def manifest(margin: float = 0.1, policy: bool = True) -> dict:
    """A memory_manifest.json as kvprobe memory writes it, with a stored summary and TOST that are wrong on
    purpose: the report and summary.json recompute them from the table."""
    city = {"field_only": {"value": 1.0, "k": 9, "n": 9, "lo": 0.71, "hi": 1.0},
            "erratum": {"value": 0.7778, "k": 7, "n": 9, "lo": 0.31, "hi": 0.97}}
    team = {"field_only": {"agree": 4, "n": 9, "lo": 0.1, "hi": 0.8},  # as manifests named k before it had a value
            "erratum": {"agree": 8, "n": 9, "lo": 0.45, "hi": 0.99}}
    return {"command": "memory", "n": 18, "seed": 0, "form": "auto", "sessions": 3, "session_tokens": [120, 200],
            "questions_per_user": 3, "seams": list(SEAMS), "margin": margin, "alpha": 0.05, "n_users": 6,
            "model": {"spec": "toy-qwen2", "family": "qwen2"},
            "summary": [{"group": "qa", "arm": "late", "accuracy": 0.123}],
            "equivalence": [{"arm": "late", "against": "early", "n": 99, "only_a": 0, "only_b": 0, "diff": 0.777,
                             "lo": 0.7, "hi": 0.8, "confidence": 0.9, "margin": margin, "equivalent": True}],
            "policy": {"threshold": 0.9, "candidates": ["field_only", "erratum"], "calibration_users": 20,
                       "default": "oracle",
                       "fields": {"city": {"repair": "field_only", "verdict": "established", "elements": 9,
                                           "changed": 9, "reason": "field_only's lower bound reaches 0.9",
                                           "strategies": city},
                                  "team": {"repair": "erratum", "verdict": "established", "elements": 9,
                                           "changed": 8, "reason": "field_only ruled out; erratum established",
                                           "strategies": team}}} if policy else None}


def memory_folder(path, policy: bool = True, repair_column: bool = True, margin: float = 0.1):
    path.mkdir(parents=True)
    df = memory_table(policy=policy)
    if not repair_column:  # a folder written before the policy arm
        df = df.drop(columns="repair")
    atomic_write_parquet(df, path / MEMORY)
    (path / MEMORY_MANIFEST).write_text(json.dumps(manifest(margin, policy)))
    return path


def section(html: str) -> str:
    return html.split('<section id="memory"', 1)[1].split("</section>", 1)[0]


def test_the_section_draws_every_arm_the_tosts_and_the_policy_from_the_table(tmp_path):
    folder = memory_folder(tmp_path / "mem")
    html = render_html([folder])
    assert sections(html) == ["memory"] and columns(html, "memory") == ["toy-qwen2"]
    body = section(html)
    assert "User memory" in html and "1. User memory" in html
    assert re.findall(r'<tr data-arm="([^"]+)"', body) == [a for _, a in arms(SEAMS, policy=True)]
    df = pd.read_parquet(folder / MEMORY)
    summ = summarize_memory(df, 0.1).set_index("arm")
    assert "policy</code> (" + summ.loc["policy", "repairs"] + ")" in html_lib.unescape(body)
    assert "erratum 9" in summ.loc["policy", "repairs"]  # the three odd users' three questions each
    assert "3 errors" in body  # field_only on the last user's three questions
    tost = equivalence(df, 0.1, 0.05).set_index("arm")
    assert re.findall(r'<tr data-pair="([^"]+)"', body) == ["transplant_seam0 - transplant_full",
                                                            "transplant_seam4 - transplant_full", "late - early"]
    late = tost.loc["late"]
    assert f"{late['diff']:+.3f}" in body and f"[{late['lo']:+.3f}, {late['hi']:+.3f}]" in body
    assert "+0.777" not in body  # the manifest's stored TOST is not what is drawn
    assert "±0.1" in body and "90% interval" in body
    assert re.findall(r'<tr data-fact="([^"]+)"', body) == ["city", "team"]
    assert "9/9 [0.71, 1.00]" in body and "7/9 [0.31, 0.97]" in body and "20 calibration users" in body
    assert "4/9 [0.10, 0.80]" in body and "8/9 [0.45, 0.99]" in body


def test_summary_fact_validates_and_its_sentence_is_the_tables_numbers(tmp_path):
    folder = memory_folder(tmp_path / "mem")
    data = summarize_run(load_run(folder))
    jsonschema.validate(data, schema())
    assert check_json(data, "summary.json") > 50  # every statistic one shape, durations in seconds
    m = data["memory"]
    assert data["headline"] == [m["sentence"]] and data["weight_edit"] is None and data["repair"] is None
    df = pd.read_parquet(folder / MEMORY)
    summ = summarize_memory(df, 0.1).set_index("arm")
    tost = equivalence(df, 0.1, 0.05).set_index("arm")

    def share(arm: str, name: str) -> str:  # as the report prints it (Stat.text)
        r = summ.loc[arm]
        return Stat(r[name], r[f"{name}_lo"], r[f"{name}_hi"], int(r[f"{name}_n"])).text()

    s = m["sentence"]
    assert s.startswith(f"Memory: late placement accuracy {share('late', 'accuracy')} vs early "
                        f"{share('early', 'accuracy')} (late - early: ")
    for arm in ("late", "transplant_seam0", "transplant_seam4"):
        t = tost.loc[arm]
        assert (f"difference {t['diff']:+.3f}, 90% [{t['lo']:+.3f}, {t['hi']:+.3f}] n={t['n']}, equivalent at "
                f"±0.1: {'yes' if t['equivalent'] else 'no'}") in s, arm
    assert "transplant_seam0 vs full recompute: difference" in s
    assert f"erratum {share('erratum', 'agreement')}, field_only {share('field_only', 'agreement')}" in s
    assert f"policy ({summ.loc['policy', 'repairs']}) {share('policy', 'agreement')}" in s
    assert f"neutral {share('neutral', 'negative_changed')}" in s
    page = html_lib.unescape(render_html([folder]))  # the sentence's numbers are the page's, to the digit
    late = tost.loc["late"]
    assert f"[{late['lo']:+.3f}, {late['hi']:+.3f}]" in page and share("late", "accuracy").split(" n=")[0] in \
        re.sub(r"<[^>]+>", "", page).replace("  ", " ")
    by = {a["arm"]: a for a in m["arms"]}
    assert list(by) == [a for _, a in arms(SEAMS, policy=True)]
    assert by["field_only"]["errors"] == 3 and by["field_only"]["accuracy"]["n"] == 2 * 5
    assert by["early"]["agreement"]["n"] == 0 and by["early"]["repairs"] is None
    assert by["late"]["accuracy"]["value"] == pytest.approx(summ.loc["late", "accuracy"], abs=1e-4)
    assert by["transplant_seam0"]["wall_s"] == pytest.approx(0.12)
    late = next(t for t in m["equivalence"] if t["arm"] == "late")
    assert late["difference"]["value"] == pytest.approx(tost.loc["late", "diff"], abs=1e-4)
    assert late["equivalence_margin"] == 0.1 and late["confidence"] == pytest.approx(0.9)
    assert m["policy"] == {"threshold": 0.9, "fields": {"city": {"repair": "field_only", "verdict": "established",
                                                                 "elements": 9},
                                                        "team": {"repair": "erratum", "verdict": "established",
                                                                 "elements": 9}}}


def test_a_folder_without_the_repair_column_or_a_manifest_still_reports(tmp_path):
    """Folders written before the policy arm have no ``repair`` column; a table without its manifest uses
    kvprobe memory's defaults (margin and alpha 0.05)."""
    old = memory_folder(tmp_path / "old", policy=False, repair_column=False)
    bare = memory_folder(tmp_path / "bare", policy=False)
    (bare / MEMORY_MANIFEST).unlink()
    for folder in (old, bare):
        data = summarize_run(load_run(folder))
        jsonschema.validate(data, schema())
        m = data["memory"]
        assert m["policy"] is None and all(a["repairs"] is None for a in m["arms"])
        assert "policy" not in {a["arm"] for a in m["arms"]}
    margins = {t["equivalence_margin"] for t in summarize_run(load_run(bare))["memory"]["equivalence"]}
    assert margins == {0.05}
    html = render_html([old, bare])
    assert sections(html) == ["memory"] and len(columns(html, "memory")) == 2
    assert "Per-field policy" not in html and "±0.1" in html and "±0.05" in html


@pytest.mark.parametrize("margin", [0, 1.5, "wide"])
def test_a_manifest_margin_out_of_range_is_one_line(tmp_path, margin):
    folder = memory_folder(tmp_path / "mem")
    data = json.loads((folder / MEMORY_MANIFEST).read_text())
    (folder / MEMORY_MANIFEST).write_text(json.dumps({**data, "margin": margin}))
    with pytest.raises(KvprobeError, match=r"memory_manifest.json has margin .* number in \(0, 1\)"):
        summarize_run(load_run(folder))
