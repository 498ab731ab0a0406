"""The report is a pure function of results folders: deterministic bytes, sections only where their
table exists, nothing fetched, one column per model."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys

import pandas as pd
import pytest
import yaml

from kvprobe.reports.folder import TTFT
from kvprobe.reports.html import render_html, render_report
from kvprobe.reports.sections import in_order
from kvprobe.datasets.tokens import TOKENS
from kvprobe.results import COMPOSE, EDITS, KNOCKOUT, LINEAR, LOCALITY, RUN_MANIFEST

# every registered section but those drawn from tables the fixture runs do not write
ALL = [s.id for s in in_order() if s.id not in ("compose", "serving", "weight_edit", "memory")]
SVG_NAMESPACES = {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}


def sections(html: str) -> list[str]:
    return re.findall(r'<section id="(\w+)"', html)


def columns(html: str, section: str) -> list[str]:
    body = html.split(f'<section id="{section}"', 1)[1].split("</section>", 1)[0]
    return re.findall(r'<div class="col" data-model="([^"]*)"', body)


def svgs(html: str) -> list[str]:
    return [base64.b64decode(m).decode() for m in re.findall(r"data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)", html)]


def test_same_folder_gives_identical_bytes(tiny_results, tmp_path):
    a = render_report([tiny_results], tmp_path / "a.html").read_bytes()
    b = render_report([tiny_results], tmp_path / "b.html").read_bytes()
    assert a == b
    # and in a fresh interpreter (hash seeds, import order, font caches differ)
    code = ("import sys; from kvprobe.reports.html import render_html; "
            "sys.stdout.buffer.write(render_html([sys.argv[1]]).encode())")
    fresh = subprocess.run([sys.executable, "-c", code, str(tiny_results)], capture_output=True, timeout=300,
                           env={"PYTHONHASHSEED": "123", **_env()})
    assert fresh.returncode == 0, fresh.stderr.decode()[-2000:]
    assert fresh.stdout == a


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}


def test_every_section_of_a_full_run(tiny_results):
    html = render_html([tiny_results])
    assert sections(html) == ALL
    assert html.count("<img ") >= 6  # edits x2, locality, linear, knockout x2
    for sid in ALL:
        assert columns(html, sid) == ["tiny-qwen2"]


@pytest.mark.parametrize("missing, gone", [(KNOCKOUT, ["knockout"]), (LINEAR, ["linear"]), (EDITS, ["edits"]),
                                           (LOCALITY, ["notes", "locality"]), ("topk.yaml", ["topk"])])
def test_section_only_where_its_table_exists(variant, missing, gone):
    folder = variant()
    (folder / missing).unlink()
    html = render_html([folder])
    assert sections(html) == [s for s in ALL if s not in gone]


def test_manifest_only_folder_gives_run_facts_only(variant):
    folder = variant()
    for f in folder.iterdir():
        if f.name != RUN_MANIFEST:
            f.unlink()
    html = render_html([folder])
    assert sections(html) == ["headline", "facts"]  # the answer from the manifest: its valid cases
    assert "tiny-qwen2" in html and "weights_hash" in html


def test_not_a_results_folder(tmp_path):
    from kvprobe.errors import KvprobeError

    with pytest.raises(KvprobeError, match="not a kvprobe results folder"):
        render_html([tmp_path])
    with pytest.raises(KvprobeError, match="not found"):
        render_html([tmp_path / "nope"])


def test_nothing_references_the_network_but_the_yaml(variant):
    folder = variant()
    topk = yaml.safe_load((folder / "topk.yaml").read_text())
    topk["source"] = "https://example.org/model-card"
    (folder / "topk.yaml").write_text(yaml.safe_dump(topk, sort_keys=False))
    html = render_html([folder])
    pre = re.findall(r'<pre class="yaml">(.*?)</pre>', html, flags=re.S)
    assert len(pre) == 1 and "https://example.org/model-card" in pre[0]  # the YAML, verbatim
    outside = html.replace(pre[0], "")
    assert not re.search(r"(?i)(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", outside)
    assert not re.search(r"(?i)<(script|link|iframe|object|embed)\b|@import|url\(", outside)
    assert set(re.findall(r'src="([a-z]+):', outside)) <= {"data"}
    for svg in svgs(html):  # inside the figures: only XML namespace names, which are never fetched
        assert set(re.findall(r"https?://[^\s\"'<>]+", svg)) <= SVG_NAMESPACES


def test_several_folders_one_column_per_model(variant):
    a, b = variant("a"), variant("b")
    m = json.loads((b / RUN_MANIFEST).read_text())
    m["config"]["model"] = "tiny-other"
    (b / RUN_MANIFEST).write_text(json.dumps(m))
    (b / KNOCKOUT).unlink()
    html = render_html([a, b])
    assert sections(html) == ALL
    for sid in ALL:
        assert columns(html, sid) == ["tiny-qwen2", "tiny-other"]
    knock = html.split('<section id="knockout"', 1)[1].split("</section>", 1)[0]
    assert "Not in this folder (no knockout.parquet)" in knock
    assert "repeat(2, minmax(0, 1fr))" in html
    # the same model twice: the labels name the folders
    assert columns(render_html([a, variant("c")]), "facts") == ["tiny-qwen2 (a)", "tiny-qwen2 (c)"]


def test_notes_map_shows_the_prompt_with_field_and_decision(tiny_results):
    html = render_html([tiny_results])
    notes = html.split('<section id="notes"', 1)[1].split("</section>", 1)[0]
    tokens = pd.read_parquet(tiny_results / TOKENS)
    assert 1 <= notes.count('<div class="case"') <= 3
    case = re.search(r'data-case="([^"]+)"', notes).group(1)
    field = tokens[(tokens.case_id == case) & (tokens.region == "field")]
    assert 'class="tok field"' in notes and 'class="tok decision"' in notes and 'class="tok downstream' in notes
    assert f"\u2192 {''.join(field.token_new).strip()}" in notes  # the new value beside the field
    assert "Share of |effect| by token kind" in notes
    # every token of the case is shown (the joined prompt minus markup equals the tokens' text)
    block = notes.split(f'data-case="{case}"', 1)[1].split('<div class="notes-map">', 1)[1].split("</div>", 1)[0]
    text = re.sub(r"<sup[^>]*>.*?</sup>|<span class=\"newval\"[^>]*>.*?</span>|<[^>]+>", "", block)
    import html as html_lib

    shown = html_lib.unescape(text).replace("\u21b5", "")
    assert shown == "".join(tokens[tokens.case_id == case].sort_values("position").token)


def test_notes_map_without_token_text(variant):
    folder = variant()
    (folder / TOKENS).unlink()
    html = render_html([folder])
    assert "notes" in sections(html)
    assert "has no tokens.parquet" in html


def test_small_samples_are_called_inconclusive(tiny_results):
    html = render_html([tiny_results])
    assert "too few cases to conclude" in html
    assert "inconclusive" in html
    # every printed statistic carries its n
    for stat in re.findall(r'<span class="stat"[^>]*>.*?</span></span>|<span class="stat"[^>]*>.*?n=\d+</span>',
                           html):
        assert "n=" in stat


def test_cot_side_by_side(variant):
    folder = variant()
    e = pd.read_parquet(folder / EDITS)
    e = pd.concat([e, e.assign(cot=64)], ignore_index=True)
    e.to_parquet(folder / EDITS, index=False)
    html = render_html([folder])
    edits = html.split('<section id="edits"', 1)[1].split("</section>", 1)[0]
    assert "Without and with chain-of-thought" in edits
    assert "<th>cot=0</th><th>cot=64</th>" in edits


def test_cot_budgets_are_summarised_over_the_same_cases(variant):
    from kvprobe.reports.sections.edits import build_edits
    from kvprobe.reports.folder import load_run

    folder = variant()
    e = pd.read_parquet(folder / EDITS).assign(valid=True)
    cases = sorted(e[~e.control].case_id.unique())
    cot = e.assign(cot=64, valid=~e.case_id.eq(cases[0]))  # one case no longer valid after reasoning
    pd.concat([e, cot], ignore_index=True).to_parquet(folder / EDITS, index=False)
    d = build_edits(load_run(folder))
    n = {(r["strategy"], r["cot"]): r["n"] for r in d["rows"]}
    assert n[("oracle", 0)] == n[("oracle", 64)] == len(cases)  # paired: the case stays in the cot=64 rows
    assert d["still_valid"] == [{"cot": 64, "n": len(cases), "valid": len(cases) - 1}]
    html = render_html([folder])
    assert f"With cot=64, {len(cases) - 1} of {len(cases)} stay valid" in html


def test_composition_and_ttft(tmp_path):
    folder = tmp_path / "validate"
    folder.mkdir()
    rows = [{"model": "tiny-llama", "query_id": f"q{q}", "seam": s, "rerotate": rot,
             "agree": (q + s) % 3 != 0 or rot, "cosine": 0.99 - 0.01 * (not rot) + 0.001 * s, "kl": 0.01 * q}
            for q in range(12) for s in (0, 1, 4) for rot in (True, False)]
    pd.DataFrame(rows).to_parquet(folder / COMPOSE, index=False)
    (folder / "compose_manifest.json").write_text(json.dumps({"command": "validate", "model": {"spec": "tiny-llama"},
                                                              "n": 12, "seams": [0, 1, 4], "gated_seam": 4}))
    html = render_html([folder])
    assert sections(html) == ["headline", "compose", "facts"]  # the answer: the gate at seam 4
    assert ("Composition gate fails: a moved, re-rotated block agrees with a full prefill 1.00 [0.76, 1.00] "
            "n=12 at seam 4 (threshold 0.9 on the lower bound, which is below it)") in html  # 12 of 12: too few
    assert columns(html, "compose") == ["tiny-llama"]
    assert "No TTFT benchmark result" in html
    pd.DataFrame([{"block_tokens": L, "full_s": L / 1000 * (1 + r / 10), "compose_s": 0.1, "speedup": L / 100}
                  for L in (512, 2048) for r in range(3)]).to_parquet(folder / TTFT, index=False)
    html = render_html([folder])
    assert "Time to first token" in html and "TTFT speedup against block length" in html
    # a compose table without the needed columns is named, not drawn
    pd.DataFrame({"seam": [0], "cosine": [0.9]}).to_parquet(folder / COMPOSE, index=False)
    assert "lacks the column(s) rerotate, agree" in render_html([folder])


def _serving_rows() -> pd.DataFrame:
    """A small serve-bench table: two loads, four arms, the erratum cached and the edit not."""
    from kvprobe.serving.bench import COLUMNS

    rows = []
    for rate, wall in ((1.0, 12.0), (float("inf"), 6.0)):
        for arm, cached, ttft in (("unchanged", 1472, 0.05), ("edit_unique", 32, 1.5), ("edit_set", 700, 0.6),
                                  ("erratum", 1440, 0.08)):
            for i in range(12):
                rows.append({c: None for c in COLUMNS} | {
                    "model": "smollm2-135m", "served_model": "smollm2-135m", "rate": rate, "arm": arm,
                    "request": i, "value": f"v{i}", "prompt_tokens": 1500, "cached_tokens": float(cached),
                    "cached_reported": True, "ceiling_tokens": max(cached, 32), "hit_rate": cached / 1500,
                    "ttft_s": ttft * (1 + i / 10), "latency_s": ttft + 0.1, "send_s": i / 2, "finish_s": i / 2 + 1,
                    "answer": "yes", "text": " yes", "reference": "yes" if i % 6 else "no", "rule_answer": "yes",
                    "agree": float(bool(i % 6)), "ok": True, "error": "", "run_sent": 12, "run_wall_s": wall,
                    "run_queries": 18000.0, "run_hits": 12.0 * cached, "block_size": 32,
                    "base_prompt_tokens": 1480})
    return pd.DataFrame(rows)


def test_serving_section(variant, tmp_path):
    from kvprobe.results import SERVING, SERVING_MANIFEST

    alone = tmp_path / "serving-only"
    alone.mkdir()
    _serving_rows().to_parquet(alone / SERVING, index=False)
    (alone / SERVING_MANIFEST).write_text(json.dumps({"served_model": "smollm2-135m", "url": "http://127.0.0.1:1",
                                                      "block_size": 32, "policy": {"erratum_ceiling": 0.96}}))
    html = render_html([alone])
    assert sections(html) == ["serving"] and columns(html, "serving") == ["smollm2-135m"]
    body = html.split('<section id="serving"', 1)[1].split("</section>", 1)[0]
    assert body.count("<img ") == 2  # hit-rate bars; TTFT and throughput against load
    assert "Erratum against the in-prefix edit" in body and "saturation" in body
    assert "96.0%" in body and "2.1%" in body  # erratum and edit hit rates, from the counters
    assert "cannot tell a right answer from a stuck one" not in body
    _serving_rows().assign(reference="yes").to_parquet(alone / SERVING, index=False)
    assert "oracle gave one answer for every value of edit_unique, edit_set, erratum" in render_html([alone])
    # beside a probe run: its own section, before the run facts; absent where there is no serving.parquet
    folder = variant()
    _serving_rows().to_parquet(folder / SERVING, index=False)
    assert sections(render_html([folder])) == ALL[:-1] + ["serving", "facts"]
    both = render_html([folder, variant("plain")])
    assert "Not in this folder (no serving.parquet)" in both.split('<section id="serving"', 1)[1]
    _serving_rows().drop(columns=["run_hits"]).to_parquet(alone / SERVING, index=False)
    assert "lacks the column(s) run_hits" in render_html([alone])


def test_cli_report(tiny_results, tmp_path):
    from typer.testing import CliRunner

    from kvprobe.cli.app import app

    out = tmp_path / "r.html"
    res = CliRunner().invoke(app, ["report", str(tiny_results), str(tiny_results), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert out.exists() and len(columns(out.read_text(), "facts")) == 2


def test_case_tokens_rebuild_the_prompt():
    from kvprobe.datasets import Skip, align, generate
    from kvprobe.datasets.render import render_pair
    from kvprobe.datasets.tokens import TOKEN_COLUMNS, case_tokens
    from tests.conftest import tiny_model

    lm = tiny_model("tiny-qwen2")
    aligned = [a for a in (align(c, lm.tokenizer, "auto") for c in generate(3, seed=0)) if not isinstance(a, Skip)]
    df = case_tokens(lm, aligned)
    assert list(df.columns) == list(TOKEN_COLUMNS)
    for a in aligned:
        t = df[df.case_id == a.case.case_id].sort_values("position")
        assert len(t) == a.decision_pos + 1 and list(t.kind) == a.kinds[: a.decision_pos + 1]
        assert "".join(t.token) == render_pair(a.case, lm.tokenizer, a.form).text_old
        field = t[t.region == "field"]
        assert (field.token != field.token_new).any() and (t[t.region != "field"].token == t[t.region != "field"]
                                                           .token_new).all()
        assert t.region.iloc[-1] == "decision" and t.region.iloc[0] == "sink"
