"""Toy field-edit models: a small model of each family's HF class, trained here in minutes.

``toy-<family>`` is a 4-layer model (hidden 128, 4 query heads, 2 kv heads, head dim 32, the
family's own RoPE, norms and soft-capping) over the word-level tokenizer, trained from scratch on
raw-form prompts of the field-edit generator. Loss is on the answer token only: the logits at the
last prompt token (the decision position) against the first token of the expected option. Each
is an ordinary Hugging Face folder with a training manifest (:data:`MANIFEST`) beside it. The six
toys ship inside the package (:data:`SHIPPED`, seed 0), so every machine loads the same weights;
``kvprobe toy train`` reproduces one from its recipe into ``$KVPROBE_HOME/models/toy-<family>/``.

Sliding windows: gemma2 alternates sliding and global layers (sliding, global, sliding, global);
gemma3 slides on layers 0, 1 and 3 with one global layer 2 (local RoPE base 1e4, global 1e6);
mistral slides on every layer. The window is :data:`WINDOW` tokens, well under a prompt's
length, so the sliding path matters. llama, qwen2 and qwen3 attend globally.

Trained-in behaviours (so that nobody mistakes one for a finding):

- *The decision follows the field value.* Each training case renders with its old or its new
  value, the answer following the value. All eight generator domains, both templates per domain,
  every decision field, all three field positions, 0-6 filler rules.
- *An erratum line overrides the field.* 30% of decision examples carry a state-update paragraph
  before ``## Request``, half in :data:`~kvprobe.datasets.SHORT_ERRATUM` form and half in the
  paper's long template (the editor's default). The answer follows the erratum's value. A quarter
  of those errata restate the field's own value, so the model has to read the erratum's value
  rather than learn "an erratum flips the answer".
- *Negative controls are ignored.* 25% of cases are generator controls (a timestamp, nonce or
  request_id line edited, the answer unchanged), rendered with either control value; control values
  are drawn from the generator's pools. In every example a control line is removed with
  probability 0.2 and an absent one added with probability 0.2. 15% of control cases carry an
  erratum on their *control* field, which must not move the answer either.

So: the decision following the field, an erratum overriding it, and control-invariance are all
trained in. What is *not* trained is how the model implements them: which positions hold notes
about the field, which heads read them, and what a KV edit does. Those are for the probes. Each
decision value has one polarity in every domain (``gold`` always allows), so the toys learn
value -> answer and need not read the rule line.

Recipe (:class:`ToyTrain`): AdamW, lr 3e-3 (2e-3 for mistral and gemma2, see :data:`FAMILY_TRAIN`)
with warm-up and cosine decay, 800 steps of 16 prompts, float32 throughout (eager attention), one
torch thread. (bfloat16 autocast, used before, is emulated on CPUs without AVX-512 BF16, where a
step took 3.5 s instead of 0.37 s, and it takes other kernels on other CPU types.) Batches are
right-padded, so every prompt keeps positions 0..L-1 and the loss reads its last real token,
exactly as an unpadded prefill would.

Held-out evaluation (:func:`evaluate_toy`) draws fresh cases with another seed, up to 9 filler
rules (1.5x the training maximum), and two synthetic unseen domains whose field names and values
were never a decision field or value in training. A model that reads values it memorised scores
chance there (~0.5). That is expected, and reported only so nobody reads more into these models.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import SafetensorError

from kvprobe.datasets import (
    CONTROL_FIELDS,
    SHORT_ERRATUM,
    DecisionField,
    DomainSpec,
    EditCase,
    Template,
    erratum_text,
    generate,
    render_prompt,
)
from kvprobe.datasets.spans import option_ids
from kvprobe.decision import option_scores
from kvprobe.errors import KvprobeError
from kvprobe.models.adapter import families
from kvprobe.models.tiny import tiny_config, word_tokenizer
from kvprobe.paths import models_dir

MANIFEST = "toy_manifest.json"
TOY_SEED = 0
EVAL_SEED = 10_001
WINDOW = 64
OPTIONS = ("yes", "no")

# The shared architecture, then what each family adds (sliding windows, Gemma's query scale).
ARCH: dict[str, Any] = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
FAMILY_ARCH: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {"use_sliding_window": False},
    "qwen3": {"use_sliding_window": False},
    "mistral": {"sliding_window": WINDOW},
    "gemma2": {"sliding_window": WINDOW, "query_pre_attn_scalar": 32,
               "layer_types": ["sliding_attention", "full_attention"] * 2},
    "gemma3": {"sliding_window": WINDOW, "query_pre_attn_scalar": 32,
               "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]},
}


@dataclass(frozen=True)
class ToyData:
    """What the training stream holds (see the module docstring for what each part trains in)."""

    fillers: tuple[int, int] = (0, 6)
    controls: float = 0.25  # fraction of generator control cases
    p_erratum: float = 0.3  # decision examples with an erratum paragraph
    p_erratum_same: float = 0.25  # of those, errata that restate the field's own value
    p_short_erratum: float = 0.5  # of errata, SHORT_ERRATUM form (else the paper's template)
    p_control_erratum: float = 0.15  # control cases with an erratum on the control field
    p_remove_control: float = 0.2  # drop one control line
    p_add_control: float = 0.2  # add one absent control line


@dataclass(frozen=True)
class ToyTrain:
    """Optimiser settings: AdamW, linear warm-up then cosine decay to ``lr * final_lr_frac``."""

    steps: int = 800
    batch_size: int = 16  # at equal compute, 16 x 800 learns far better than 32 x 400 here
    lr: float = 3e-3
    warmup: int = 40
    final_lr_frac: float = 0.05
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    grad_clip: float = 1.0
    bf16_autocast: bool = False  # bfloat16 matmuls: emulated (10x slower) on CPUs without AVX-512 BF16
    threads: int = 1  # fixed, so the weights do not depend on the machine's core count


# Where a family learns better with other settings: all-sliding mistral and soft-capped gemma2
# are unsteady at lr 3e-3 (mistral's loss jumps early; both end far above the others).
FAMILY_TRAIN: dict[str, dict[str, Any]] = {"mistral": {"lr": 2e-3}, "gemma2": {"lr": 2e-3}}


def toy_recipe(family: str) -> ToyTrain:
    """The training settings of ``toy-<family>``: :class:`ToyTrain` with the family's overrides."""
    return replace(ToyTrain(), **FAMILY_TRAIN.get(toy_family(family), {}))


@dataclass(frozen=True)
class Example:
    """One training or evaluation prompt and the option it should answer."""

    text: str
    answer: str
    kind: str


def toy_families() -> list[str]:
    return sorted(families())


def toy_family(spec: str) -> str:
    """``toy-qwen3`` -> ``qwen3``; an unknown family is a :class:`KvprobeError` listing them."""
    fam = spec[4:] if spec.startswith("toy-") else spec
    if fam not in FAMILY_ARCH or fam not in families():
        known = ", ".join(f"toy-{f}" for f in toy_families())
        raise KvprobeError(f"unknown toy model {spec!r}; known: {known}")
    return fam


def toy_dir(family: str) -> Path:
    """Where ``kvprobe toy train`` saves a retrained toy by default (the shipped one is :func:`shipped_dir`)."""
    return models_dir() / f"toy-{toy_family(family)}"


def toy_config(family: str, vocab_size: int, arch: dict | None = None):
    """The HF config of ``toy-<family>`` (``arch`` replaces parts of :data:`ARCH`, for tests)."""
    family = toy_family(family)
    overrides = {**ARCH, **FAMILY_ARCH[family], **(arch or {})}
    n = overrides["num_hidden_layers"]
    if "layer_types" in overrides and len(overrides["layer_types"]) != n:  # a reduced depth: keep the pattern
        pattern = FAMILY_ARCH[family]["layer_types"]
        overrides["layer_types"] = [pattern[i % len(pattern)] for i in range(n)]
    return tiny_config(f"tiny-{family}", vocab_size, **overrides)


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 over every tensor's name, shape, dtype and bytes (same recipe as ``LoadedModel.weights_hash``)."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# -- data ------------------------------------------------------------------------------------


def _answer_for(case: EditCase, value: str) -> str:
    if case.control:
        return case.expected_old
    return case.expected_old if value == case.old_value else case.expected_new


def _drop_line(text: str, key: str, value: str) -> str:
    line = f"\n{key}: {value}"
    assert text.count(line) == 1, (key, value)
    return text.replace(line, "", 1)


def _with_control_line(rng: random.Random, case: EditCase) -> EditCase:
    """``case`` with one absent control field added to its record (unchanged when none is absent)."""
    present = {k for k, _ in case.record} | {case.field}
    absent = [name for name in CONTROL_FIELDS if name not in present]
    if not absent:
        return case
    name = rng.choice(absent)
    record = list(case.record)
    record.insert(rng.randint(0, len(record)), (name, rng.choice(CONTROL_FIELDS[name])))
    return case.model_copy(update={"record": record})


def _without_control_line(rng: random.Random, case: EditCase) -> EditCase | None:
    """``case`` with one of its record's control lines removed (None when it has none)."""
    present = [i for i, (k, _) in enumerate(case.record) if k in CONTROL_FIELDS]
    if not present:
        return None
    drop = rng.choice(present)
    return case.model_copy(update={"record": [kv for i, kv in enumerate(case.record) if i != drop]})


def training_examples(n: int, seed: int, data: ToyData = ToyData()) -> list[Example]:
    """``n`` training prompts (raw form), deterministic in ``seed``; see the module docstring."""
    rng = random.Random(seed * 7919 + 17)
    out = []
    for case in generate(n, seed=seed, controls=data.controls, fillers=data.fillers):
        drop_field_line = False
        if rng.random() < data.p_remove_control:
            shorter = _without_control_line(rng, case)
            if case.control and (shorter is None or rng.random() < 0.34):
                drop_field_line = True  # the edited control line itself goes
            elif shorter is not None:
                case = shorter
        if rng.random() < data.p_add_control:
            case = _with_control_line(rng, case)
        value = rng.choice([case.old_value, case.new_value])
        answer, erratum, kind = _answer_for(case, value), None, "control" if case.control else "decision"
        template = SHORT_ERRATUM if rng.random() < data.p_short_erratum else None
        if not case.control and rng.random() < data.p_erratum:
            other = case.new_value if value == case.old_value else case.old_value
            said = value if rng.random() < data.p_erratum_same else other
            erratum, answer, kind = erratum_text(case.field, said, template), _answer_for(case, said), "erratum"
        elif case.control and rng.random() < data.p_control_erratum:
            said = rng.choice([v for v in CONTROL_FIELDS[case.field] if v != value])
            erratum, kind = erratum_text(case.field, said, template), "control_erratum"
        text = render_prompt(case, None, value, "raw", erratum=erratum)
        if drop_field_line:
            text, kind = _drop_line(text, case.field, value), "control_removed"
        out.append(Example(text, answer, kind))
    return out


# Two domains the toys never see: field names and values that are never a decision field or
# value in training (all words of the generator's vocabulary, so none is [UNK]).
UNSEEN_DOMAINS: tuple[DomainSpec, ...] = (
    DomainSpec(
        name="unseen_room",
        templates=(Template("unseen_room.t0", "You are a support assistant for a small office.",
                            "Should the request be approved?", "Approve a request only if {field} is {allowed}."),),
        fields=(DecisionField("room", ("private", "large"), ("small", "separate")),
                DecisionField("zone", ("local", "internal"), ("abroad", "manual"))),
        fillers=("Documents are stored in shared folders.", "Printing is logged by the office.",
                 "Staff wear name badges.", "The office wiki is updated on Mondays.",
                 "Replies should be short and polite.", "Logs are kept for thirty days.",
                 "Metrics are stored for a year.", "Dashboards refresh every minute.",
                 "The gate opens at six.", "Fees are listed in the price sheet."),
        context=("The user needs the file for a meeting.", "The ticket was opened this morning."),
        record=(("device", ("laptop", "tablet", "phone")),),
    ),
    DomainSpec(
        name="unseen_slot",
        templates=(Template("unseen_slot.t0", "You process requests for a software team.",
                            "Is this request allowed to go out?", "A request may go out only when {field} is {allowed}."),),
        fields=(DecisionField("slot", ("morning", "evening"), ("weekend", "nightly")),
                DecisionField("lane", ("fast", "quick"), ("four", "separate"))),
        fillers=("Release notes are written in the changelog.", "Each service has its own dashboard.",
                 "Build caches are cleared every Sunday.", "Docs live next to the code.",
                 "Alerts are grouped by service.", "Quiet hours start at ten.",
                 "Seals are checked on arrival.", "Stock is counted every evening.",
                 "Trucks queue in lane four.", "Scanners are calibrated every week."),
        context=("The request came from the release channel.", "The team wants to ship before the weekend."),
        record=(("team", ("platform", "payments", "storage")),),
    ),
)


def unseen_cases(n: int, seed: int, fillers: tuple[int, int]) -> list[EditCase]:
    """``n`` decision cases over :data:`UNSEEN_DOMAINS`, answers alternating."""
    from kvprobe.datasets.generate import _draw  # the generator's own case builder, on other domains

    rng = random.Random(seed)
    cases = []
    for i in range(n):
        spec = UNSEEN_DOMAINS[i % len(UNSEEN_DOMAINS)]
        cases.append(_draw(rng, spec, case_id=f"{spec.name}-s{seed}-{i:04d}", control=False,
                           allow_first=(i // len(UNSEEN_DOMAINS)) % 2 == 0, decision=spec.fields,
                           control_fields=list(CONTROL_FIELDS), fillers=fillers,
                           positions=("early", "middle", "late"), system=True, cot=False))
    return cases


# -- forward passes ----------------------------------------------------------------------------


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
def predict(model, tokenizer, texts: Sequence[str], batch_size: int = 64) -> list[str]:
    """The arg-max option (yes/no) for each raw prompt, batched by length."""
    opt_ids = {o: option_ids(tokenizer, o) for o in OPTIONS}
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    preds: list[str] = [""] * len(ids)
    for lo in range(0, len(order), batch_size):
        chunk = order[lo : lo + batch_size]
        scores = option_scores(decision_logits(model, [ids[i] for i in chunk]), opt_ids, list(OPTIONS))
        for i, k in zip(chunk, scores.argmax(-1).tolist()):
            preds[i] = OPTIONS[k]
    return preds


# -- evaluation --------------------------------------------------------------------------------

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
# What a toy is for, each on at least 95% of held-out prompts: deciding by the field, following an
# erratum, ignoring control fields. A run probes only the cases a model gets right under both
# values, so a toy's errors cost cases, never correctness; 0.95 leaves ~90% of cases valid. (The
# earlier 0.98 sat within one or two prompts of the recipe's results, so a retrain on another CPU
# type could fail it by chance: 0.967 on an Intel machine.) A recipe has room to spare when every
# seed clears every threshold by MARGIN (6 of the 300 decision prompts); docs/toys.md has the seeds.
THRESHOLDS = {"acc_old": 0.95, "acc_new": 0.95, "acc_erratum": 0.95, "acc_erratum_short": 0.95,
              "inv_control_value": 0.95, "inv_control_added": 0.95, "inv_control_removed": 0.95}
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
        plus = _with_control_line(rng, c)
        minus = _without_control_line(rng, c)
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


# -- training ----------------------------------------------------------------------------------


def _lr_at(step: int, t: ToyTrain) -> float:
    if step < t.warmup:
        return t.lr * (step + 1) / t.warmup
    frac = (step - t.warmup) / max(1, t.steps - t.warmup)
    return t.lr * (t.final_lr_frac + (1 - t.final_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def _batches(lengths: list[int], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Shuffled batches of similar lengths (sorted within pools of 16 batches), in shuffled order."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    pool = batch_size * 16
    batches = []
    for lo in range(0, len(order), pool):
        chunk = sorted(order[lo : lo + pool], key=lambda i: lengths[i])
        batches += [chunk[j : j + batch_size] for j in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return [b for b in batches if len(b) == batch_size]


@dataclass
class ToyResult:
    """What :func:`train_toy` made: the model, its tokenizer, the manifest, and the folder (if saved)."""

    model: Any
    tokenizer: Any
    manifest: dict
    folder: Path | None = None
    paths: list[Path] = field(default_factory=list)


@contextlib.contextmanager
def _torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _fit(model, ids: list[list[int]], targets: torch.Tensor, batches: list[list[int]], train: ToyTrain,
         on_step: Callable[[int, int, float], None]) -> list[list[float]]:
    """The optimisation loop: cross-entropy at each prompt's last token only. Returns the loss curve."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": train.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=train.lr, betas=train.betas)
    model.train()
    curve, ema = [], 0.0
    for step in range(train.steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, train)
        batch = batches[step]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=train.bf16_autocast):
            logits = decision_logits(model, [ids[i] for i in batch])  # (B, V) at the decision token
        loss = torch.nn.functional.cross_entropy(logits.float(), targets[batch])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        opt.step()
        ema = loss.item() if step == 0 else 0.95 * ema + 0.05 * loss.item()
        if step % 25 == 0 or step == train.steps - 1:
            curve.append([step, round(ema, 5)])
        on_step(step + 1, train.steps, ema)
    model.eval()
    return curve


def train_toy(family: str, *, seed: int = TOY_SEED, train: ToyTrain | None = None, data: ToyData = ToyData(),
              arch: dict | None = None, save: bool = True, n_eval: int = 400, out: Path | None = None,
              on_step: Callable[[int, int, float], None] = lambda step, total, loss: None,
              progress: Callable[[str], None] = lambda s: None) -> ToyResult:
    """Train ``toy-<family>`` from scratch, evaluate it held out, and save it (atomically).

    Deterministic: the same seed and settings give bit-identical weights (on one torch build; the
    thread count is part of the settings, and bfloat16 autocast takes other kernels on other CPU
    types, so another CPU gives other weights). ``arch`` shrinks the model for tests; ``n_eval=0``
    skips the held-out evaluation. ``train`` defaults to the family's :func:`toy_recipe`. Saved
    to ``out`` (default :func:`toy_dir`).
    """
    family = toy_family(family)
    train = train or toy_recipe(family)
    fam = families()[family]
    tokenizer = word_tokenizer()
    config = toy_config(family, len(tokenizer), arch)
    start, cpu_start = time.perf_counter(), time.process_time()
    progress(f"drawing {train.steps * train.batch_size} training prompts")
    examples = training_examples(train.steps * train.batch_size, seed, data)
    ids = tokenizer([e.text for e in examples], add_special_tokens=False)["input_ids"]
    target_ids = {o: option_ids(tokenizer, o)[0] for o in OPTIONS}
    targets = torch.tensor([target_ids[e.answer] for e in examples])
    batches = _batches([len(x) for x in ids], train.batch_size, random.Random(seed + 1))
    while len(batches) < train.steps:  # a remainder dropped by pooling: recycle from the start
        batches.append(batches[len(batches) - train.steps])

    with _torch_threads(train.threads):
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = getattr(transformers, fam.causal_lm_class)(config).to(torch.float32)
        progress(f"training {train.steps} steps")
        curve = _fit(model, ids, targets, batches, train, on_step)
        train_s, train_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    # Evaluation is inference only, so it may use every thread: the weights are already fixed, and
    # a float32 forward pass on 2 threads runs ~1.6x faster here than on one.
    metrics: dict[str, float] = {}
    eval_s, eval_fillers = 0.0, (0, min(12, math.ceil(1.5 * data.fillers[1])))  # 12 fillers per domain
    if n_eval:
        progress("held-out evaluation")
        t0 = time.perf_counter()
        metrics = evaluate_toy(model, tokenizer, n=n_eval, n_unseen=max(20, n_eval // 4), fillers=eval_fillers,
                               train_max_fillers=data.fillers[1])
        eval_s = time.perf_counter() - t0

    manifest = {
        "spec": f"toy-{family}", "family": family, "model_class": fam.causal_lm_class, "seed": seed,
        "data": asdict(data), "train": asdict(train), "arch": {**ARCH, **FAMILY_ARCH[family], **(arch or {})},
        "n_params": sum(p.numel() for p in model.parameters()), "n_train_prompts": len(examples),
        "mean_prompt_tokens": round(sum(len(x) for x in ids) / len(ids), 1),
        "train_wall_s": round(train_s, 1), "train_cpu_s": round(train_cpu_s, 1), "eval_wall_s": round(eval_s, 1),
        "loss_curve": curve, "final_loss": curve[-1][1],
        "heldout": {"seed": EVAL_SEED, "n": n_eval, "fillers": list(eval_fillers), **metrics},
        "heldout_failures": threshold_failures(metrics) if metrics else [],
        "weights_sha256": weights_sha256(model),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "machine": machine(),
    }
    result = ToyResult(model, tokenizer, manifest)
    if save:
        result.folder, result.paths = save_toy(model, tokenizer, manifest, Path(out) if out else toy_dir(family))
    return result


def machine() -> dict:
    """The CPU a toy was trained on (bfloat16 autocast picks kernels by CPU type, so weights differ by it)."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"cpu": cpu, "arch": platform.machine(), "cores": os.cpu_count()}


def save_toy(model, tokenizer, manifest: dict, folder: Path) -> tuple[Path, list[Path]]:
    """Write the HF folder and manifest to a temporary folder, then rename it into place."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if folder.exists():
            old = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.old."))
            folder.replace(old / folder.name)
            tmp.replace(folder)
            shutil.rmtree(old)
        else:
            tmp.replace(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder, sorted(folder.iterdir())


# -- loading -----------------------------------------------------------------------------------

# The six toys ship inside the package (seed 0 of the recipe, trained once and checked here), so
# ``toy-<family>`` loads the same weights on every machine. ``kvprobe toy train`` writes a retrained
# toy to $KVPROBE_HOME/models/toy-<family>/ (or --out); load that one by its folder path.
SHIPPED = Path(__file__).parent / "toys"


def shipped_dir(family: str) -> Path:
    """The folder of the shipped ``toy-<family>`` inside the package."""
    return SHIPPED / f"toy-{toy_family(family)}"


def read_manifest(folder: Path) -> dict | None:
    """A toy folder's manifest (None when it has none); a corrupt one is a :class:`KvprobeError`."""
    path = Path(folder) / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KvprobeError(f"{path} is not a readable toy manifest ({type(exc).__name__}); "
                           f"retrain the toy with `kvprobe toy train --force`") from None
    if not isinstance(manifest, dict) or not {"family", "weights_sha256"} <= set(manifest):
        raise KvprobeError(f"{path} is not a toy manifest (it needs family and weights_sha256); "
                           f"retrain the toy with `kvprobe toy train --force`")
    return manifest


def _note(manifest: dict, where: str) -> str:
    h = manifest.get("heldout", {})
    if "acc_old" not in h:
        return f"toy model {where} on the field-edit task"
    acc = min(h["acc_old"], h["acc_new"])
    return f"toy model {where} on the field-edit task; held-out acc {acc:.2f}, erratum {h['acc_erratum']:.2f}"


def load_toy_folder(folder: Path | str, *, allow_failed: bool = False):
    """(model, tokenizer, note) from a toy folder, checked against its manifest.

    Refused in one line: a folder without a readable manifest, weights whose hash differs from
    the manifest's, and (unless ``allow_failed``) a toy whose manifest records a held-out failure.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None:
        raise KvprobeError(f"{folder} has no {MANIFEST}; a toy folder is made by `kvprobe toy train`")
    family = toy_family(manifest["family"])
    failures = manifest.get("heldout_failures") or []
    if failures and not allow_failed:
        raise KvprobeError(f"{folder} failed its own held-out check ({'; '.join(failures)}); retrain it with "
                           f"`kvprobe toy train --family {family} --seed N --force`, use the shipped toy-{family}, "
                           f"or pass --allow-failed-toy to use it anyway")
    cls = getattr(transformers, families()[family].causal_lm_class)
    try:
        model = cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
        # Not AutoTokenizer: for model type qwen2 it swaps in Qwen2Tokenizer, whose own pre-tokenizer
        # splits words differently from the word-level tokenizer the toy was trained with.
        tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise KvprobeError(f"{folder} does not load as a toy model ({first}); "
                           f"retrain it with `kvprobe toy train --family {family} --force`") from None
    if weights_sha256(model) != manifest["weights_sha256"]:
        raise KvprobeError(f"{folder} does not match its {MANIFEST} (weights hash differs); "
                           f"retrain it with `kvprobe toy train --family {family} --force`")
    where = "shipped with kvprobe, trained" if folder.resolve().parent == SHIPPED.resolve() else "trained"
    return model, tokenizer, _note(manifest, where) + (f"; FAILED {'; '.join(failures)}" if failures else "")


def load_toy(spec: str, *, allow_failed: bool = False):
    """(model, tokenizer, note) for the shipped ``toy-<family>``, checked against its manifest."""
    folder = shipped_dir(spec)
    if not (folder / MANIFEST).exists():
        raise KvprobeError(f"the shipped {spec} is missing from the package ({folder}); reinstall kvprobe, or "
                           f"train one with `kvprobe toy train --family {toy_family(spec)}` and pass its folder")
    return load_toy_folder(folder, allow_failed=allow_failed)


def compare_heldout(retrained: dict, shipped: dict) -> list[tuple[str, float, float, float]]:
    """Rows (metric, retrained, shipped, difference) over :data:`METRICS` present in both."""
    return [(k, retrained[k], shipped[k], retrained[k] - shipped[k]) for k in METRICS
            if k in retrained and k in shipped]


def toy_rows() -> list[tuple[str, ...]]:
    """Rows (name, family, params, download, cached, notes) for ``kvprobe models``."""
    rows = []
    for family in toy_families():
        manifest = read_manifest(shipped_dir(family))
        if manifest is None:
            rows.append((f"toy-{family}", family, "-", "-", "missing", "the shipped toy is missing; reinstall kvprobe"))
            continue
        rows.append((f"toy-{family}", family, f"{manifest['n_params'] / 1e6:.1f}M", "-", "shipped",
                     _note(manifest, "shipped with kvprobe, trained")))
    return rows
