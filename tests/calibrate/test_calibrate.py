"""kvprobe calibrate: the confidence sequence's coverage under its stopping rule, the spec and value
sets, the per-field loop on a toy (its refusals, its resume) and auto reading a field policy."""

from __future__ import annotations

import random

import pandas as pd
import torch
import pytest
import yaml

import kvprobe
from kvprobe.calibrate.engine import calibrate, load_spec, measure_pair
from kvprobe.calibrate.stats import Sequence, chain_alpha, chain_error, first_look, simulate_chain, simulate_coverage
from kvprobe.calibrate.values import parse_values
from kvprobe.errors import KvprobeError
from kvprobe.field_policy import verify
from kvprobe.editor.strategies import parse_strategy
from tests.cli.test_conventions import error_line, kvprobe as cli

TOY_SPEC = "examples/calibrate-toy.yaml"


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("p", [0.90, 0.95, 0.99])
def test_the_interval_at_the_stopping_time_covers_the_rate(p, m):
    """Bernoulli streams stopped by the shipped rule (the first look with a verdict, else 300 pairs):
    the interval reported there holds p in at least the nominal 95% of 10,000 streams, and a wrong
    verdict (established below the threshold, ruled out at or above it) is rarer than alpha."""
    seq = Sequence(threshold=0.95, m=m)
    got = simulate_coverage(p, seq, trials=10_000, max_n=300, seed=int(p * 100) + m)
    assert got["coverage"] >= got["nominal"] == pytest.approx(0.95), got
    assert got["wrong_verdicts"] <= seq.alpha_lower + seq.alpha_upper, got


@pytest.mark.parametrize("ps", [(0.90,), (0.95,), (0.99,), (0.90,) * 3, (0.95,) * 3, (0.99,) * 3, (0.3, 0.6, 0.949)])
def test_a_chain_of_candidates_keeps_the_guarantee(ps):
    """The candidates as a chain (the next measured back over the pairs so far when one is ruled
    out; 200 pairs): the interval of the candidate in play where the field stopped holds its rate in at least
    the nominal 95% of 10,000 streams, and the chosen repair is wrongly established (its rate below
    0.95) less often than alpha_lower, also where the first two are ruled out and the third sits just
    below the threshold (the chain's worst kind of case)."""
    seq = Sequence(threshold=0.95, m=len(ps), chain=200)
    assert seq.alpha == seq.alpha_lower and seq.n0 == 62  # each candidate spends all of it
    got = simulate_chain(ps, seq, trials=10_000, seed=int(ps[-1] * 100) + len(ps))
    assert got["coverage"] >= got["nominal"] == pytest.approx(0.95), got
    assert got["wrongly_established"] <= chain_error(0.95, seq.alpha, len(ps), 200) + 0.005, got
    assert chain_error(0.95, seq.alpha, len(ps), 200) <= seq.alpha_lower


def test_the_chains_error_is_computed_and_its_alpha_cut_where_it_must_be():
    """chain_error bounds the chain's error from above: a simulation of the worst kind of case
    (the first ruled out at once, the second just below the threshold) comes close under it; at
    threshold 0.5 three candidates of 200 pairs at the full alpha could exceed 0.045 (each alone
    reaches 0.031 with five unbroken agreements), so chain_alpha cuts each one's share until the
    chain's worst case is within it."""
    worst = chain_error(0.95, 0.045, 2, 200)
    got = simulate_chain((0.3, 0.949), Sequence(threshold=0.95, m=2, chain=200), trials=20_000, seed=7)
    assert 0.03 < got["wrongly_established"] <= worst + 0.004 and worst <= 0.045, (got, worst)
    assert chain_error(0.5, 0.045, 3, 200) > 0.045
    cut = chain_alpha(0.5, 3, 200)
    assert 0.015 < cut < 0.045 and chain_error(0.5, cut, 3, 200) <= 0.045
    assert Sequence(threshold=0.5, m=3, chain=200).alpha == cut


def test_a_naive_interval_would_not_cover_under_the_same_stopping():
    """The check can fail: a fixed-n 95% Clopper-Pearson interval, looked at after every pair and
    stopped by the same rule, misses p = 0.95 far more often than 5%."""
    import numpy as np
    from scipy.stats import beta

    n = np.arange(301)[:, None].astype(float)
    k = np.arange(301)[None, :].astype(float)
    with np.errstate(all="ignore"):
        lo = np.nan_to_num(np.where((k > 0) & (k <= n), beta.ppf(0.025, np.maximum(k, 1), np.maximum(n - k + 1, 1)), 0))
        hi = np.nan_to_num(np.where(k < n, beta.isf(0.025, k + 1, np.maximum(n - k, 1)), 1.0), nan=1.0)
    x = np.random.default_rng(0).random((5000, 300)) < 0.95
    ks = np.concatenate([np.zeros((5000, 1), int), np.cumsum(x, axis=1)], axis=1)
    looks = np.arange(301)[None, :]
    stop_lo, stop_hi = lo[looks, ks], hi[looks, ks]
    decided = (stop_lo >= 0.95) | (stop_hi < 0.95)
    decided[:, 0], decided[:, 300] = False, True
    at = decided.argmax(axis=1)
    rows = np.arange(5000)
    covered = (stop_lo[rows, at] <= 0.95) & (0.95 <= stop_hi[rows, at])
    assert 1 - covered.mean() > 0.06, covered.mean()


def test_the_first_look_is_where_an_unbroken_run_first_reaches_the_threshold():
    seq = Sequence(threshold=0.95, m=1)
    assert seq.n0 == first_look(0.95, 0.045) == 62
    assert seq.lower(62, 62) >= 0.95 > seq.lower(61, 61)
    assert seq.verdict(62, 62) == "established" and seq.verdict(61, 62) == "open"
    assert Sequence(threshold=0.95, m=3).n0 == 83  # three candidates share alpha (kvprobe memory's policy)
    assert Sequence(threshold=0.95, m=3, chain=200).n0 == 62  # a chain of three: as one (calibrate)
    assert seq.verdict(10, 30) == "ruled out"
    # the pairs, all agreeing, to the earliest verdict (where calibrate's batches stop computing ahead)
    assert seq.to_establish(0, 0, 200) == 62 and seq.to_establish(61, 61, 200) == 1 and seq.to_establish(0, 0, 9) == 9
    # one disagreement by pair 61: most of alpha was spent at pair 62, so no unbroken run establishes it within 200
    assert seq.to_establish(60, 61, 200) == 200 and seq.verdict(259, 260) == "open"
    assert seq.to_establish(40, 41, 1000) == next(m for m in range(1, 1000) if seq.verdict(40 + m, 41 + m) != "open")


def test_value_sets():
    rng = random.Random(0)
    assert parse_values(["a", "b"], "x").other("a", rng) == "b"
    ts = parse_values("timestamp", "x").sample(rng)
    assert len(ts) == 16 and ts[4] == "-" and ts[10] == " "
    assert parse_values("id:ord", "x").sample(rng).startswith("ord-")
    assert 3 <= int(parse_values("int:3:5", "x").sample(rng)) <= 5
    for bad, text in ((["a", "a"], "two different"), ("int:5:3", "LO < HI"), ("colour", "unknown value set"),
                      ("", "not a value set")):
        with pytest.raises(KvprobeError, match=text):
            parse_values(bad, "f.yaml: fields.x")


def test_a_bad_spec_is_one_line_naming_the_file(tmp_path):
    good = yaml.safe_load(open(TOY_SPEC))
    cases = {"no-question": {k: v for k, v in good.items() if k != "question"},
             "extra-field": {**good, "fields": {**good["fields"], "nonce": ["n1", "n2"]}},
             "one-option": {**good, "options": ["yes"]}, "unknown-key": {**good, "colour": 1}}
    for name, data in cases.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data))
        with pytest.raises(KvprobeError, match=name.split("-")[0] if name != "extra-field" else "fields") as exc:
            load_spec(path)
        assert str(path) in str(exc.value) and "\n" not in str(exc.value)


@pytest.fixture(scope="module")
def toy():
    return kvprobe.load("toy-qwen2")


def test_a_pair_is_scored_against_the_oracle(toy):
    spec = load_spec(TOY_SPEC)
    base = {"subscription_tier": "gold", "timestamp": "2024-05-01T10:00", "request_id": "req-31842"}
    df = measure_pair(toy, spec, "subscription_tier", base, "free", ["field_only", "erratum_turn"])
    assert list(df.strategy) == ["stale", "oracle", "field_only", "erratum_turn"]
    oracle, stale = (df[df.strategy == s].iloc[0] for s in ("oracle", "stale"))
    assert oracle.agree and oracle.pred == oracle.reference  # edits.parquet's vocabulary (kvprobe.editor.score)
    assert set(df.changed) == {oracle.reference != stale.pred}
    assert (df.agree == (df.pred == df.reference)).all()
    assert (df.to_decision_s == df.wall_s + df.decide_s).all()


def test_the_shared_prefix_gives_each_pair_the_cache_a_full_prefill_gives(toy):
    """calibrate prefills the template's text before its first field once: each pair's old cache
    continues that prefix, and equals a full prefill of the old prompt (float32) on every pair, with
    the same decisions; the prefix is cropped, not recomputed, when a pair shares fewer tokens."""
    from kvprobe.api import aligned_edit
    from kvprobe.calibrate.engine import SharedPrefix, _pairs, context_for
    from kvprobe.kv import cache as kvcache

    spec, prefix, running = load_spec(TOY_SPEC), SharedPrefix(toy), SharedPrefix(toy)
    saved = []
    for name in spec.fields:
        for _, (base, new) in list(_pairs(spec, name, 0, 3)):
            ctx = context_for(toy, spec, base)
            a = aligned_edit(toy, ctx.case(name, new), ctx.form)
            shared = prefix.old_cache(a.ids_old[:a.decision_pos])
            _, full = kvcache.prefill(toy.model, torch.tensor(a.ids_old[:a.decision_pos]), logits_to_keep=1)
            for (k1, v1), (k2, v2) in zip(kvcache.to_tensors(shared), kvcache.to_tensors(full)):
                assert torch.allclose(k1, k2, atol=1e-4) and torch.allclose(v1, v2, atol=1e-4)
            saved.append(prefix.tokens_saved)
            with_prefix = measure_pair(toy, spec, name, base, new, ["field_only"], prefix=running)
            assert list(with_prefix.pred) == list(measure_pair(toy, spec, name, base, new, ["field_only"]).pred)
    assert saved[0] == 0 and saved[-1] > saved[1] > 0  # the first prompt is prefilled whole, then shared
    assert 0 < len(prefix.ids) < len(a.ids_old) and running.tokens_saved == prefix.tokens_saved


@pytest.mark.parametrize("model", ["toy-qwen2", "tiny-gemma3"])
def test_the_oracle_from_the_shared_prefix_is_the_full_prefills(model):
    """calibrate's oracle reuses the old prompt's cache up to the field and prefills the new prompt
    from there: on every pair (three per field, float32; a sliding-window family too) the same
    decision as a full prefill of the new prompt, the decision logits within 1e-4, the old cache
    untouched, and only the tokens from the field on computed."""
    from kvprobe.api import aligned_edit
    from kvprobe.calibrate.engine import _pairs, context_for
    from kvprobe.editor.context import make_context
    from kvprobe.editor.strategies import Oracle, PrefixOracle, apply
    from kvprobe.kv import cache as kvcache
    from kvprobe.kv.decode import decide

    lm = kvprobe.load(model)
    spec = load_spec(TOY_SPEC)
    for name in spec.fields:
        for _, (base, new) in _pairs(spec, name, 0, 3):
            ctx = context_for(lm, spec, base)
            a = aligned_edit(lm, ctx.case(name, new), ctx.form)
            ec = make_context(lm, a)
            before = [k.clone() for k, _ in kvcache.to_tensors(ec.old_cache)]
            full, shared = apply(ec, Oracle()), apply(ec, PrefixOracle())
            assert shared.recomputed == a.decision_pos - a.field[0] < full.recomputed == a.decision_pos
            got, want = decide(lm, shared, 0)[0], decide(lm, full, 0)[0]
            assert (got - want).abs().max() < 1e-4 and got.argmax() == want.argmax()
            assert all(torch.equal(k, b) for (k, _), b in zip(kvcache.to_tensors(ec.old_cache), before))
            rows = {o: measure_pair(lm, spec, name, base, new, ["field_only"], oracle=o) for o in ("prefix", "full")}
            assert list(rows["prefix"].reference) == list(rows["full"].reference)
            margins = [r.loc[r.strategy == "oracle", "margin"].iloc[0] for r in rows.values()]
            assert abs(margins[0] - margins[1]) < 1e-4


def test_an_edit_the_tokenizer_cannot_see_is_refused_not_ranked(toy, tmp_path):
    """toy-qwen2's tokenizer maps unknown words to [UNK]: an edit between two of them changes no
    token id, so no repair is ranked; the field is called degenerate after 10 such draws."""
    data = yaml.safe_load(open(TOY_SPEC))
    data["fields"]["request_id"] = ["zzqxa", "yyqwb", "wwvuc"]
    (tmp_path / "unk.yaml").write_text(yaml.safe_dump(data))
    for procedure in ("chain", "shared"):
        cal = calibrate(toy, load_spec(tmp_path / "unk.yaml"), max_pairs=1, candidates=["field_only"],
                        procedure=procedure)
        res = {f.name: f for f in cal.fields}["request_id"]
        assert res.verdict == "degenerate" and res.chosen == "none" and res.pairs == 0 and res.skipped == 10
        assert "same token ids" in res.reason and "[UNK]" in res.reason
        entry = cal.policy["fields"]["request_id"]
        assert entry["relevance"] == "degenerate" and entry["strategies"]["field_only"]["verdict"] == "not measured"
        verify(cal.policy, tmp_path / "p.yaml", parse_strategy)  # what it writes, it reads, either procedure


def test_calibrate_command_writes_a_policy_and_resumes_with_a_larger_budget(tmp_path):
    out = tmp_path / "cal"
    first = cli("calibrate", TOY_SPEC, "--model", "toy-qwen2", "--max-pairs", "2", "--out", out)
    assert first.returncode == 1, first.stderr[-2000:]  # no verdict within 2 pairs: said, exit 1
    assert "no verdict within 2 pairs" in first.stderr
    # after the first batch of pairs (both here), what the whole template will cost at that rate (2 pairs at most)
    assert "the first 2 pairs took" in first.stderr and "the template's 3 fields take about" in first.stderr
    assert "if each is settled at 2 pairs" in first.stderr
    policy = yaml.safe_load((out / "field_policy.yaml").read_text())
    assert policy["kvprobe_field_policy"] == 4 and set(policy["fields"]) == {"subscription_tier", "timestamp",
                                                                              "request_id"}
    assert all(f["repair"] == "oracle" and f["verdict"] == "budget" for f in policy["fields"].values())
    # what kvprobe writes, it reads (verified against its own counts and its template)
    verify(policy, out / "field_policy.yaml", parse_strategy).check_spec(load_spec(TOY_SPEC))
    rows = pd.read_parquet(out / "calibration.parquet")
    again = cli("calibrate", TOY_SPEC, "--model", "toy-qwen2", "--max-pairs", "3", "--out", out)
    assert again.returncode == 1, again.stderr[-2000:]
    assert "fields take about" not in again.stderr  # resumed first pairs took nothing: no projection from them
    more = pd.read_parquet(out / "calibration.parquet")
    keep = ["field", "old_value", "new_value", "strategy", "pred", "reference"]
    first_pairs = more.merge(rows[keep], on=keep, how="inner")
    assert len(first_pairs) == len(rows)  # the first two pairs of each field were read back, not redrawn
    assert len(more) == len(rows) * 3 // 2
    line = error_line(cli("calibrate", TOY_SPEC, "--model", "toy-qwen2", "--threshold", "0.9", "--out", out), 2)
    assert "calibration with other settings" in line and "threshold" in line
    # the same spec with its fields listed in another order: the same digest, but another draw sequence
    data = yaml.safe_load(open(TOY_SPEC))
    data["fields"] = dict(reversed(list(data["fields"].items())))
    (tmp_path / "reordered.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    assert load_spec(tmp_path / "reordered.yaml").digest() == load_spec(TOY_SPEC).digest()
    line = error_line(cli("calibrate", tmp_path / "reordered.yaml", "--model", "toy-qwen2", "--max-pairs", "3",
                          "--out", out), 2)
    assert "calibration with other settings" in line and "field_order" in line
    assert pd.read_parquet(out / "calibration.parquet").equals(more)  # nothing mixed in


def test_a_chain_measures_the_candidate_in_play_and_brings_the_next_in_over_the_pairs_so_far(toy, tmp_path):
    """cacheblend:0.15 keeps toy-qwen2's stale decision on most gating edits: given first, it is
    measured alone until ruled out; then field_only is measured back over those pairs and goes on,
    established on 62 pairs in all. The rows hold what was counted; the policy verifies, and one
    whose counts do not follow the chain is refused."""
    data = yaml.safe_load(open(TOY_SPEC))
    data["fields"] = {"subscription_tier": data["fields"]["subscription_tier"]}
    data["template"] = data["template"].replace("timestamp: {timestamp}\nrequest_id: {request_id}\n", "")
    (tmp_path / "tier.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    cal = calibrate(toy, load_spec(tmp_path / "tier.yaml"), candidates=["cacheblend:0.15", "field_only"],
                    max_pairs=100)
    (res,) = cal.fields
    seq = Sequence(threshold=0.95, m=2, chain=100)
    (kb, nb), (kf, nf) = res.counts["cacheblend:0.15"], res.counts["field_only"]
    assert 0 < nb < 62 and seq.verdict(kb, nb) == "ruled out" and "open" in (seq.verdict(kb, nb - 1),
                                                                            seq.verdict(kb - 1, nb - 1)), (kb, nb)
    assert (res.chosen, res.verdict, kf, nf, res.pairs) == ("field_only", "established", 62, 62, 62)
    measured = cal.rows[~cal.rows.strategy.isin(["stale", "oracle"])]
    assert (measured.strategy == "cacheblend:0.15").sum() == nb and (measured.strategy == "field_only").sum() == 62
    entry = cal.policy["fields"]["subscription_tier"]["strategies"]
    assert entry["cacheblend:0.15"]["agreement"]["n"] == nb and entry["field_only"]["agreement"]["n"] == 62
    verify(cal.policy, tmp_path / "p.yaml", parse_strategy)
    moved = yaml.safe_load(yaml.safe_dump(cal.policy))  # one pair more for cacheblend: it was ruled out before
    e = moved["fields"]["subscription_tier"]["strategies"]["cacheblend:0.15"]
    e["agreement"].update(n=nb + 1, value=round(kb / (nb + 1), 4), lo=round(seq.lower(kb, nb + 1), 4),
                          hi=round(seq.upper(kb, nb + 1), 4))
    e["n_unchanged"] += 1
    e["flip_hi"] = round(1 - seq.lower(e["n_unchanged"] - e["spurious_flips"], e["n_unchanged"]), 4)
    with pytest.raises(KvprobeError, match="a chain moves on only where the candidate in play is ruled out"):
        verify(moved, tmp_path / "p.yaml", parse_strategy)
    moved = yaml.safe_load(yaml.safe_dump(cal.policy))  # field_only's unchanged pairs not the field's
    e = moved["fields"]["subscription_tier"]["strategies"]["field_only"]
    e["n_unchanged"] -= 1
    e["flip_hi"] = round(1 - seq.lower(e["n_unchanged"] - e["spurious_flips"], e["n_unchanged"]), 4)
    with pytest.raises(KvprobeError, match="the candidate a chain ends on counts every pair"):
        verify(moved, tmp_path / "p.yaml", parse_strategy)


def test_the_shared_procedure_measures_every_candidate_on_every_pair(toy, tmp_path):
    """procedure="shared" (what calibrate did before the chain): every candidate on every pair, their
    lower bounds sharing alpha_lower (83 pairs at 0.95 for three); its policy says so and verifies."""
    cal = calibrate(toy, TOY_SPEC, max_pairs=3, procedure="shared", oracle="full",
                    candidates=["field_only", "erratum_turn"])
    measured = cal.rows[cal.rows.skip.isna()]
    for _, pair in measured.groupby(["field", "old_value", "new_value", "others"]):
        assert list(pair.strategy) == ["stale", "oracle", "field_only", "erratum_turn"]
    assert all(res.counts[c][1] == res.pairs for res in cal.fields for c in res.counts)
    assert cal.policy["procedure"] == "shared" and "shared by 2 candidates" in cal.policy["method"]
    verify(cal.policy, tmp_path / "p.yaml", parse_strategy)
    with pytest.raises(KvprobeError, match="procedure must be one of chain, shared"):
        calibrate(toy, TOY_SPEC, max_pairs=1, procedure="bonferroni")


def test_calibrate_says_what_the_template_costs_and_when_bfloat16_is_emulated(monkeypatch):
    from kvprobe.cli import calibrate as cli_calibrate

    line = cli_calibrate.projection(2.0, 3, 62, 200)
    assert "2.0 s" in line and "about 6 min if each is settled at 62 pairs" in line and "at most 20 min" in line
    line = cli_calibrate.projection(1.1, 3, 62, 100, first=4)  # the first batch of pairs, computed together
    assert line.startswith("the first 4 pairs took 1.1 s a pair") and "about 3 min if each is settled at 62" in line
    monkeypatch.setattr("kvprobe.hardware.native_bf16", lambda: False)
    note = cli_calibrate.bf16_note("bfloat16", "cpu")
    assert note.startswith("note: this CPU has no native bfloat16") and "--dtype float32" in note
    assert cli_calibrate.bf16_note("float32", "cpu") is None
    monkeypatch.setattr("kvprobe.hardware.native_bf16", lambda: True)
    assert cli_calibrate.bf16_note("bfloat16", "cpu") is None


def spec_context(lm, spec, values, **kwargs) -> kvprobe.EditableContext:
    """An EditableContext holding a calibration spec's prompt at ``values`` (as calibrate builds it)."""
    ctx = kvprobe.EditableContext(lm, system=spec.system, **kwargs)
    for kind, x in spec.pieces:
        ctx.add_text(x) if kind == "text" else ctx.add_field(x, values[x])
    return ctx.ask(spec.question, spec.options)


def test_auto_takes_the_repair_each_field_was_calibrated_to(toy, tmp_path):
    """A field policy names a repair per field: auto applies it without its runtime check, says
    why (the reason recomputed from the file's counts). A policy is refused on another prompt, on
    another model, and when its verdict does not follow from its counts."""
    from kvprobe import field_policy

    data = yaml.safe_load(open(TOY_SPEC))
    data["fields"] = {"subscription_tier": data["fields"]["subscription_tier"]}
    data["template"] = data["template"].replace("timestamp: {timestamp}\nrequest_id: {request_id}\n", "")
    (tmp_path / "tier.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    spec = load_spec(tmp_path / "tier.yaml")
    cal = calibrate(toy, spec, candidates=["field_only"], max_pairs=62)
    assert cal.policy["fields"]["subscription_tier"]["verdict"] == "established"
    path = field_policy.write(cal.policy, tmp_path / "field_policy.yaml")
    ctx = spec_context(toy, spec, {"subscription_tier": "gold"}, policy=path)
    state = ctx.edit(subscription_tier="free")
    assert state.chose == "field_only" and "established" in state.reason and "62 of 62 pairs" in state.reason
    assert state.answer() == ctx.edit(strategy="field_only", subscription_tier="free").answer()
    # another prompt (the full toy spec): refused, not applied
    other = spec_context(toy, load_spec(TOY_SPEC), {"subscription_tier": "gold", "timestamp": "2024-05-01T10:00",
                                                    "request_id": "req-31842"}, policy=path)
    with pytest.raises(KvprobeError, match="was calibrated on another prompt"):
        other.edit(subscription_tier="free")
    tampered = yaml.safe_load(path.read_text())
    tampered["fields"]["subscription_tier"]["repair"] = "stale"
    (tmp_path / "stale.yaml").write_text(yaml.safe_dump(tampered, sort_keys=False))
    with pytest.raises(KvprobeError, match="fields.subscription_tier.repair is 'stale'"):
        kvprobe.EditableContext(toy, policy=tmp_path / "stale.yaml")
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**cal.policy, "threshold": 5}))
    with pytest.raises(KvprobeError, match=r"threshold is 5, accepted: a number in \[0.5, 1\)"):
        kvprobe.EditableContext(toy, policy=tmp_path / "bad.yaml")
    other_model = kvprobe.load("toy-llama")
    with pytest.raises(KvprobeError, match="was calibrated for toy-qwen2"):
        kvprobe.EditableContext(other_model, policy=str(path))


@pytest.mark.parametrize("model", ["toy-qwen2", "tiny-gemma3"])
def test_pairs_prefilled_as_one_batch_give_the_one_by_one_decisions(model):
    """Issue 54, item 2: several pairs' old caches and prefix oracles prefilled as one batch (the default, 4
    pairs; kvprobe.calibrate.batch), and their reads as few forwards (field_only's recompute fused with its read),
    against one by one (pair_batch=1): the same pairs, the same rows, every
    decision the same and every margin within 1e-4 (float32; a sliding-window family too); each old cache and
    oracle state equals a one-by-one prefill's within 1e-4 (the oracle read in the batch's reads: its decision
    logits)."""
    from kvprobe.calibrate.batch import PairStates
    from kvprobe.calibrate.engine import SharedPrefix, _pairs, aligned_pair
    from kvprobe.editor.strategies import PrefixOracle, apply
    from kvprobe.editor.context import EditContext
    from kvprobe.kv import cache as kvcache
    from kvprobe.kv.decode import decide

    lm = kvprobe.load(model)
    spec = load_spec(TOY_SPEC)
    batched, alone = (calibrate(lm, spec, max_pairs=6, pair_batch=b) for b in (4, 1))
    assert (batched.pair_batch, alone.pair_batch, alone.states_unused) == (4, 1, 0)
    # the batched pairs' reads (stale, oracle, field_only fused with its recompute) were read across pairs
    assert batched.rows.read_batch.max() > 3 >= alone.rows.read_batch.max()
    assert calibrate(lm, spec, max_pairs=2, pair_batch=4, batch_reads=False).rows.read_batch.max() == 1
    keys = ["field", "old_value", "new_value", "others", "strategy"]
    a, b = (c.rows.sort_values(keys).reset_index(drop=True) for c in (batched, alone))
    assert list(a[keys].itertuples(index=False)) == list(b[keys].itertuples(index=False))
    assert list(a.pred) == list(b.pred) and list(a.reference) == list(b.reference)
    assert (a.margin - b.margin).abs().max() < 1e-4
    name = next(iter(spec.fields))
    pairs = [(k, aligned_pair(lm, spec, name, base, new)) for k, (base, new) in _pairs(spec, name, 3, 5)]
    prefix = SharedPrefix(lm)
    prefix.old_cache(pairs[0][1].ids_old[: pairs[0][1].decision_pos])  # the first prompt sets the prefix
    for reads in (True, False):  # the oracle read in the reads' forward, or prefilled as a cache of its own
        states = PairStates(lm, prefix, 4, reads=reads)
        for k, pair in pairs[1:]:
            got, old_one = states.get(k, iter(pairs[1:])), SharedPrefix(lm).old_cache(pair.ids_old[: pair.decision_pos])
            assert got[0] is pair
            for (k1, v1), (k2, v2) in zip(kvcache.to_tensors(got[1]), kvcache.to_tensors(old_one)):
                assert k1.shape == k2.shape and torch.allclose(k1, k2, atol=1e-4) and torch.allclose(v1, v2, atol=1e-4)
            want = apply(EditContext(lm, pair, old_one), PrefixOracle())
            if reads:
                assert got[2].cache is None and got[3]["oracle"][0] is got[2]
                assert float((got[3]["oracle"][1][0] - decide(lm, want)[0]).abs().max()) < 1e-4
            else:
                for (k1, v1), (k2, v2) in zip(kvcache.to_tensors(got[2].cache), kvcache.to_tensors(want.cache)):
                    assert k1.shape == k2.shape
                    assert torch.allclose(k1, k2, atol=1e-4) and torch.allclose(v1, v2, atol=1e-4)
            assert (got[2].tail_ids, got[2].recomputed, got[2].ids) == (want.tail_ids, want.recomputed, want.ids)
        assert (states.computed, states.used, states.unused) == (4, 4, 0)


def test_states_computed_past_a_verdict_are_counted_unused_never_scored(toy, monkeypatch):
    """The stopping rule reads the pairs one by one in draw order; a batch computes the states of the next 4
    pairs ahead, and those of pairs past a field's last are dropped: counted in states_unused and the manifest,
    never in the rows. A batch ends at the earliest pair the field could stop at (its budget here), so none is
    computed past it; a stop no count foresees (a last candidate ruled out) is emulated by batches that ignore it.
    Three fields of at most 3 pairs: each field's batch takes its pairs 1-4 (1 unused; the first also sets the
    shared prefix)."""
    cal = calibrate(toy, TOY_SPEC, max_pairs=3)
    assert cal.states_unused == 0 and cal.pair_batch == 4
    monkeypatch.setattr(Sequence, "to_establish", lambda self, k, n, limit: 4)
    blind = calibrate(toy, TOY_SPEC, max_pairs=3)
    assert all(res.pairs + res.skipped == 3 for res in blind.fields)
    assert blind.states_unused == 3 and blind.pair_batch == 4
    assert len(blind.rows.groupby(["field", "old_value", "new_value", "others"])) == 9
    same = ["field", "old_value", "new_value", "others", "strategy", "pred", "reference", "agree"]
    assert blind.rows[same].equals(cal.rows[same]) and (blind.rows.margin - cal.rows.margin).abs().max() < 1e-4


def test_a_candidate_measured_back_on_kept_states_gives_the_recomputed_rows(toy, tmp_path):
    """Issue 54: a candidate joining the chain is measured back over the pairs so far on the states their batch
    computed (kept, not prefilled again; its reads a batch of pairs at a time): the same rows as measuring it back
    one by one (pair_batch=1, each pair's old cache and oracle prefilled again), every decision the same and every
    margin within 1e-4 (float32). Once the last candidate is in play nothing is kept (none can join)."""
    data = yaml.safe_load(open(TOY_SPEC))
    data["fields"] = {"subscription_tier": data["fields"]["subscription_tier"]}
    data["template"] = data["template"].replace("timestamp: {timestamp}\nrequest_id: {request_id}\n", "")
    (tmp_path / "tier.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    spec = load_spec(tmp_path / "tier.yaml")
    runs = [calibrate(toy, spec, candidates=["cacheblend:0.15", "field_only"], max_pairs=30, pair_batch=b)
            for b in (4, 1)]
    (res,) = runs[0].fields
    nb = res.counts["cacheblend:0.15"][1]
    # every pair's states were kept (the first batch also set the shared prefix)
    assert 0 < nb < 30 and runs[0].states_reused == nb and runs[1].states_reused == 0
    # read back a batch of pairs at a time (4 kept pairs' field_only reads here), none alone
    assert (runs[0].rows[runs[0].rows.strategy == "field_only"].read_batch > 1).all()
    keys = ["field", "old_value", "new_value", "others", "strategy"]
    a, b = (c.rows.sort_values(keys).reset_index(drop=True) for c in runs)
    assert list(a[keys].itertuples(index=False)) == list(b[keys].itertuples(index=False))
    assert list(a.pred) == list(b.pred) and list(a.reference) == list(b.reference) and list(a.agree) == list(b.agree)
    assert (a.margin - b.margin).abs().max() < 1e-4
    assert [r.counts for r in runs[0].fields] == [r.counts for r in runs[1].fields]
