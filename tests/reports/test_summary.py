"""The answer first: summary.json (validated against its schema), the report's headline section, the
rule that picks the repair, and ``kvprobe compare`` over three folders in all its output forms."""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

import jsonschema
import pandas as pd
import pytest
from typer.testing import CliRunner

from kvprobe.cli.app import app
from kvprobe.reports.compare import to_csv
from kvprobe.reports.folder import load_run
from kvprobe.reports.html import render_html
from kvprobe.reports.summary import SUMMARY, repair, schema, summarize_run, write_summary
from kvprobe.results import COMPOSE, EDITS
from tests.cli.test_errors import kvprobe, one_line_error

runner = CliRunner()


def _stat(value, lo, hi, n):
    return {"value": value, "lo": lo, "hi": hi, "n": n}


def _row(name, value, lo, n, frac, seconds=0.01, kept=1.0, n_controls=90):
    return {"strategy": name, "n": n, "errors": 0, "agreement": _stat(value, lo, 1.0, n), "recovery": None,
            "control_invariance": _stat(kept, 0.0, 1.0, n_controls), "frac_recomputed": frac, "repair_s": seconds,
            "to_decision_s": seconds, "notes": []}


def test_summary_json_validates_and_headline_leads(tiny_results, tmp_path):
    folder = tmp_path / "run"
    import shutil

    shutil.copytree(tiny_results, folder)
    path = write_summary(folder)
    assert path == folder / SUMMARY
    data = json.loads(path.read_text())
    jsonschema.validate(data, schema())
    assert data["kvprobe_summary"] == 6 and data["weight_edit"] is None and data["memory"] is None and data["headline"]
    assert data["validity"]["decision"] == 3
    assert [r["strategy"] for r in data["strategies"]] == ["stale", "field_only", "selective:4:random", "erratum",
                                                           "oracle"]
    html = render_html([folder])
    ids = re.findall(r'<section id="([a-z_]+)" class="section"', html)
    assert ids[0] == "headline" and ids.index("headline") < ids.index("notes")
    head = html[html.index('<section id="headline"'):html.index("</section>", html.index('<section id="headline"'))]
    for fact in ("where", "repair", "k_star", "validity"):
        assert f'data-fact="{fact}"' in head
    assert "wrong under old value wrong under new value" not in html
    # section numbers follow what is shown: 1, 2, 3, ... with no gap
    numbers = [int(n) for n in re.findall(r"<h2>(\d+)\. ", html)]
    assert numbers == list(range(1, len(numbers) + 1))


def test_the_schema_refuses_what_it_does_not_describe(tiny_results):
    data = summarize_run(load_run(tiny_results))
    jsonschema.validate(data, schema())
    for broken in ({**data, "kvprobe_summary": 1}, {**data, "extra": 1},
                   {**data, "repair": {**data["repair"], "agreement": {"value": 1.0}}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, schema())


def test_repair_is_the_cheapest_whose_lower_bound_reaches_the_threshold():
    rows = [_row("stale", 1.0, 0.96, 90, 0.0), _row("field_only", 0.9, 0.82, 90, 0.01),
            _row("erratum_turn", 1.0, 0.96, 90, 0.30, seconds=0.005),
            _row("cacheblend:0.15", 1.0, 0.96, 90, 0.20, seconds=0.05),
            _row("hoist", 1.0, 0.96, 90, 0.15), _row("oracle", 1.0, 0.96, 90, 1.0)]
    r = repair(rows, 0.95)  # hoist is cheaper but rewrites the prompt: never chosen (as Policy.cheapest)
    assert r["recommended"] == "cacheblend:0.15" and r["qualifying"] == ["cacheblend:0.15", "erratum_turn"]
    assert r["sentence"].startswith("Repair with cacheblend:0.15: agreement 1.00 [0.96, 1.00] n=90, 20.0% of tokens")
    assert "established on both legs at 0.95" in r["sentence"] and r["why_not"] is None
    # 15 of 15 reaches only 0.80: nothing is established, and the closest is named, not recommended
    small = [_row("field_only", 1.0, 0.7961, 15, 0.01), _row("erratum", 0.93, 0.70, 15, 0.3)]
    r = repair(small, 0.95)
    assert r["recommended"] is None and r["closest"] == "field_only" and r["cases_to_establish"] == 73
    assert "No repair is established at 0.95" in r["sentence"] and "at least 73 cases on each leg" in r["sentence"]
    assert repair([_row("field_only", 1.0, 0.7961, 15, 0.01, n_controls=15)], 0.75)["recommended"] == "field_only"


def test_a_repair_that_flips_controls_is_not_established_and_the_answer_is_per_kind_of_field():
    """The headline's rule needs both legs: the erratum agrees on every decision case but flips half the
    negative controls, so it is not the repair; per kind of field, it is for the fields that decide and
    field_only (every control kept) for the fields that must not matter."""
    rows = [_row("field_only", 0.10, 0.05, 146, 0.008, n_controls=73),
            _row("erratum", 1.0, 0.97, 146, 0.28, kept=0.5479, n_controls=73),
            _row("oracle", 1.0, 0.97, 146, 1.0, n_controls=73)]
    r = repair(rows, 0.95)
    assert r["recommended"] is None and r["per_field"] == {"decision_fields": "erratum", "control_fields": "field_only"}
    assert r["sentence"].startswith("Repair per kind of field (no single repair is established on both legs at 0.95)")
    assert "erratum is not the repair for every field: controls kept 40/73" in r["sentence"]
    # no controls measured: the second leg is open, so nothing is established
    bare = [_row("erratum", 1.0, 0.97, 146, 0.28, n_controls=0)]
    bare[0]["control_invariance"] = None
    r = repair(bare, 0.95)
    assert r["recommended"] is None and "no negative control measured" in r["why_not"]


def test_editor_notes_and_composition_reach_the_summary(variant):
    folder = variant("noted")
    edits = pd.read_parquet(folder / EDITS)
    edits["note"] = ""
    edits.loc[edits.strategy == "erratum", "note"] = "field recomputed: False"
    edits.to_parquet(folder / EDITS)
    pd.DataFrame([{"query_id": f"q{q}", "rerotate": rot, "seam": s, "agree": bool(q % 5 or not rot), "top1_agree": True,
                   "cosine": 0.99, "kl": 0.01, "wall_s": 0.1, "context_tokens": 100}
                  for q in range(20) for rot in (True, False) for s in (0, 4)]).to_parquet(folder / COMPOSE)
    data = summarize_run(load_run(folder))
    jsonschema.validate(data, schema())
    erratum = next(r for r in data["strategies"] if r["strategy"] == "erratum")
    assert erratum["notes"] == [{"note": "field recomputed: False", "cases": 3}]
    gate = data["composition"]
    assert gate["seam"] == 4 and gate["agreement"]["value"] == 0.8 and gate["passed"] is False
    assert gate["sentence"].startswith("Composition gate fails")


def test_compare_three_folders_in_every_form(variant, tmp_path):
    folders = [variant(f"m{i}") for i in range(3)]
    out_csv, out_json, out_html = tmp_path / "c.csv", tmp_path / "c.json", tmp_path / "c.html"
    res = runner.invoke(app, ["compare", *map(str, folders), "--csv", str(out_csv), "--json", str(out_json),
                              "--html", str(out_html)])
    assert res.exit_code == 0, res.output
    assert "the answer, per folder" in res.output and "share recomputed" in res.output
    data = json.loads(out_json.read_text())
    assert data["kvprobe_compare"] == 1 and len(data["runs"]) == 3
    for run in data["runs"]:
        jsonschema.validate(run, schema())
    rows = list(csv.DictReader(io.StringIO(out_csv.read_text())))
    assert len(rows) == 3 * 5 and {r["strategy"] for r in rows} >= {"stale", "oracle"}
    assert out_csv.read_text() == to_csv(data["runs"])
    html = out_html.read_text()
    assert html.count("<tr data-model=") == 3 and html.count('<tr data-strategy="') == 5
    assert "<script" not in html and "http://" not in html.replace("http://www.w3.org/", "")


def test_compare_refusals_are_one_line(variant, tmp_path):
    folder = variant("one")
    empty = tmp_path / "empty"
    empty.mkdir()
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep_manifest.json").write_text("{}")
    one_line_error(kvprobe("compare", str(empty)), "has no manifest.json", "`kvprobe run`")
    one_line_error(kvprobe("compare", str(sweep)), "is a `kvprobe sweep` folder", "kvprobe report")
    one_line_error(kvprobe("compare", str(folder), "--csv", str(tmp_path / "x.json"), "--json",
                           str(tmp_path / "x.json")), "name the same file")
    one_line_error(kvprobe("compare", str(folder), "--json", str(tmp_path / "x.csv")), "give a path ending in .json")
    proc = kvprobe("compare", str(folder), "--json")  # stdout: the JSON alone; the tables go to stderr
    assert proc.returncode == 0 and json.loads(proc.stdout)["runs"][0]["model"] and "the answer" in proc.stderr
    to_file = kvprobe("compare", str(folder), "--json", str(tmp_path / "c.json"))
    assert to_file.returncode == 0 and "wrote " in to_file.stdout
    assert (tmp_path / "c.json").read_text() == proc.stdout  # one JSON text, whichever the destination


KEPT = Path(__file__).resolve().parents[2] / "docs" / "summaries"


def test_kept_summaries_validate_against_the_schema():
    """The summaries kept in docs/summaries (real runs of two toys, and their comparison;
    docs/summary.md gives the commands) still validate: a schema change that breaks them fails here."""
    files = sorted(KEPT.glob("*.json"))
    assert files, f"no kept summary in {KEPT}"
    n_runs = 0
    for path in files:
        data = json.loads(path.read_text())
        runs = data["runs"] if "kvprobe_compare" in data else [data]
        for run in runs:
            jsonschema.validate(run, schema())
            n_runs += 1
            k = run["k_star"]
            if k and k["status"] == "not established":  # the candidate K is named, as its reason says
                assert k["k"] is not None and k["reason"].startswith(f"K={k['k']}"), k
    assert n_runs >= 4  # two summary.json files and the two runs of the comparison


def test_the_bold_repair_label_is_the_verdict_per_field(tiny_results, monkeypatch):
    """The headline's bold answer under "Repair to use" leads with what summary.json established:
    per kind of field where no single repair is, and "none established (closest ...)" only where
    nothing is."""
    from kvprobe.reports.sections import headline
    from kvprobe.reports.summary import repair_answer

    data = summarize_run(load_run(tiny_results))
    per_kind = repair([_row("field_only", 0.10, 0.05, 146, 0.008, n_controls=73),
                       _row("erratum", 1.0, 0.97, 146, 0.28, kept=0.5479, n_controls=73),
                       _row("selective:8:attention", 0.87, 0.81, 146, 0.05, kept=0.9, n_controls=73)], 0.95)
    nothing = repair([_row("field_only", 0.10, 0.05, 146, 0.008, kept=0.5, n_controls=73)], 0.95)
    for r, want in ((per_kind, "per field: erratum for the fields that decide, field_only for the fields that must "
                               "not matter"),
                    (nothing, "none established (closest: field_only)")):
        monkeypatch.setattr(headline, "summarize_run", lambda run, r=r: {**data, "repair": r})
        html = render_html([tiny_results])
        bold = re.search(r'data-fact="repair">\s*<dt>[^<]*</dt>\s*<dd><strong class="answer">([^<]*)</strong>',
                         html).group(1)
        assert bold == want == repair_answer(r)
    assert per_kind["per_field"] == {"decision_fields": "erratum", "control_fields": "field_only"}
    assert "closest" not in repair_answer(per_kind) and "selective" not in repair_answer(per_kind)
