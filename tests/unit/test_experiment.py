"""The harness every results-writing command runs on (kvprobe.experiment): its one order of checks, a refusal
that leaves nothing on disk, the executor closed when a later check refuses, steps that resume from their parts,
and the manifest and summary."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kvprobe.datasets import generate
from kvprobe.errors import KvprobeError, UsageError
from kvprobe.executor import Serial
from kvprobe.experiment import Experiment, Step
from kvprobe.results import EDIT_CLAIM, INPUTS
from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def lm():
    return tiny_model("tiny-llama")


class Recorder(Serial):
    def __init__(self, said: list):
        super().__init__()
        self.said = said

    def close(self) -> None:
        self.said.append("closed")


def experiment(tmp_path, **settings) -> Experiment:
    return Experiment("edit", tmp_path / "out", EDIT_CLAIM, {"n": 2, **settings}, held="test with other settings")


def test_open_runs_every_check_in_the_one_order_then_claims(tmp_path, lm):
    said = []
    cases = generate(2, seed=0)
    exp = experiment(tmp_path)

    def load():
        said.append("load")
        return lm

    def cases_():
        said.append("cases")
        return cases

    opened = exp.open(load, cases=cases_, before=[lambda: said.append("before")],
                      executor=lambda: (said.append("executor"), Recorder(said))[1],
                      prepare=lambda m, given: said.append("prepare") or len(given),
                      checks=[lambda m: said.append("checks")])
    assert said == ["before", "cases", "executor", "load", "prepare", "checks"]
    assert opened.lm is lm and opened.prepared == 2 and [c.case_id for c in opened.cases] == [c.case_id for c in cases]
    stored = json.loads((exp.out / INPUTS).read_text())  # the model's and each case's content, claimed
    assert sorted(stored["cases"]) == sorted(c.case_id for c in cases)
    assert json.loads((exp.out / EDIT_CLAIM).read_text()) == {"n": 2}


def test_a_refusal_before_the_claim_leaves_nothing_and_closes_the_executor(tmp_path, lm):
    said = []
    exp = experiment(tmp_path)

    def refuse(m):
        raise UsageError("refused")

    with pytest.raises(UsageError, match="refused"):
        exp.open(lambda: lm, executor=lambda: Recorder(said), checks=[refuse])
    assert said == ["closed"]
    assert not exp.out.exists()


def test_cases_without_answers_and_colliding_ids_are_refused_before_the_model_loads(tmp_path):
    loaded = []
    bare = [c.model_copy(update={"expected_old": None}) for c in generate(2, seed=0)]
    with pytest.raises(KvprobeError, match="kvprobe edit measures validity"):
        experiment(tmp_path).open(lambda: loaded.append(1), cases=lambda: bare)
    twins = generate(2, seed=0)
    twins[1] = twins[1].model_copy(update={"case_id": twins[0].case_id.upper()})
    with pytest.raises(KvprobeError, match="collide"):
        experiment(tmp_path).open(lambda: loaded.append(1), cases=lambda: twins)
    assert loaded == [] and not (tmp_path / "out").exists()


def test_a_folder_with_other_settings_is_refused_before_anything_else(tmp_path, lm):
    experiment(tmp_path).open(lambda: lm)
    said = []
    with pytest.raises(UsageError, match="test with other settings"):
        experiment(tmp_path, n=3).open(lambda: said.append("load"), before=[lambda: said.append("before")])
    assert said == []


def test_a_step_resumes_from_its_parts_and_collects_its_table(tmp_path, lm):
    computed = []

    def row(ctx, item):
        computed.append(item)
        return pd.DataFrame({"item": [item], "double": [2 * item]})

    def run_once():
        exp = experiment(tmp_path)
        exp.open(lambda: lm)
        ticks = []

        def compute(store, tick):
            return exp.opened.executor.map(store, [(str(i), i) for i in range(3)], row, None, tick)

        progress = lambda label, total: (lambda: ticks.append(label))  # noqa: E731
        df = exp.step(Step("numbers", "counting", compute, total=3), progress=progress)
        return exp, df, ticks

    exp, df, ticks = run_once()
    assert computed == [0, 1, 2] and ticks == ["counting"] * 3
    assert pd.read_parquet(exp.out / "numbers.parquet")["double"].tolist() == [0, 2, 4]
    exp, again, _ = run_once()  # a rerun: every part read, nothing computed
    assert computed == [0, 1, 2] and again.equals(df)


def test_finish_writes_the_manifest_and_hands_the_folder_to_the_summary(tmp_path, lm):
    exp = experiment(tmp_path)
    exp.open(lambda: lm)
    summarized = []
    path = exp.finish("edit_manifest.json", summarize=lambda out: summarized.append(out) or out / "summary.json",
                      n=2)
    manifest = json.loads((exp.out / "edit_manifest.json").read_text())
    assert manifest["n"] == 2 and manifest["model"] == lm.fingerprint() and "versions" in manifest
    assert summarized == [exp.out] and path == exp.out / "summary.json"
    assert exp.finish("edit_manifest.json", n=2) is None


def test_no_command_writes_the_sequence_itself():
    """Issue 51: the check -> cases -> load -> align -> claim sequence was written eight times. Every command
    that writes a results folder now opens it through Experiment, the serving benchmarks too (their folder is
    claimed by their manifest, with the served model's or the engine's identity): no other module builds a
    ResultsFolder or claims a folder itself."""
    import ast
    from pathlib import Path

    import kvprobe

    src = Path(kvprobe.__file__).parent
    homes = {src / "results.py", src / "experiment.py"}
    builds = sorted(str(p.relative_to(src)) for p in src.rglob("*.py") if p not in homes
                    for node in ast.walk(ast.parse(p.read_text()))
                    if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None))
                    in ("ResultsFolder", "claim_folder", "claim_inputs", "claim_identity"))
    assert builds == []
