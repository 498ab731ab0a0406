"""Training a toy from its recipe: deterministic per CPU type, saved atomically with its manifest."""

from __future__ import annotations

import contextlib
import functools
import math
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import transformers

from kvprobe.datasets.spans import option_ids
from kvprobe.hardware import machine
from kvprobe.models.adapter import families
from kvprobe.models.fingerprint import weights_sha256
from kvprobe.models.tiny import word_tokenizer
from kvprobe.results import json_text
from kvprobe.models.toy_folder import TOY_MANIFEST, TOY_SEED, toy_arch, toy_config, toy_dir, toy_family
from kvprobe.toys.examples import ToyData, training_examples
from kvprobe.toys.evaluate import EVAL_SEED, OPTIONS, decision_logits, evaluate_toy, threshold_failures


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
         on_step: Callable[[int, int, float], None], stop_after: int | None = None) -> list[list[float]]:
    """The optimisation loop: cross-entropy at each prompt's last token only. Returns the loss curve
    (its exponential average every 25 steps and at the last). ``stop_after`` ends the loop after
    that many of the recipe's steps, its schedule unchanged."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": train.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=train.lr, betas=train.betas)
    model.train()
    curve, ema = [], 0.0
    n_steps = train.steps if stop_after is None else min(stop_after, train.steps)
    for step in range(n_steps):
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
        if step % 25 == 0 or step == n_steps - 1:
            curve.append([step, round(ema, 5)])
        on_step(step + 1, n_steps, ema)
    model.eval()
    return curve


@functools.lru_cache(maxsize=2)
def _drawn(n: int, seed: int, data: ToyData) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]:
    """The ``n`` training prompts' word-tokenizer ids and answers: drawn and tokenised once per
    process for the same inputs (about 5 s of 12,800 prompts on a 2-core Zen 4; a test that trains a
    recipe's first steps twice, on one thread and on two, pays it once). Immutable, so a caller
    cannot change what the next one gets."""
    examples = tuple(training_examples(n, seed, data))
    ids = word_tokenizer()([e.text for e in examples], add_special_tokens=False)["input_ids"]
    return tuple(tuple(x) for x in ids), tuple(e.answer for e in examples)


def train_toy(family: str, *, seed: int = TOY_SEED, train: ToyTrain | None = None, data: ToyData = ToyData(),
              arch: dict | None = None, save: bool = True, n_eval: int = 400, out: Path | None = None,
              stop_after: int | None = None,
              on_step: Callable[[int, int, float], None] = lambda step, total, loss: None,
              progress: Callable[[str], None] = lambda s: None) -> ToyResult:
    """Train ``toy-<family>`` from scratch, evaluate it held out, and save it (atomically).

    Deterministic: the same seed and settings give bit-identical weights (on one torch build; the
    thread count is part of the settings, and bfloat16 autocast takes other kernels on other CPU
    types, so another CPU gives other weights). ``arch`` shrinks the model for tests; ``n_eval=0``
    skips the held-out evaluation. ``train`` defaults to the family's :func:`toy_recipe`. Saved
    to ``out`` (default :func:`toy_dir`). ``stop_after`` trains only the recipe's first steps (its
    data, batches and schedule unchanged), to check that a recipe still starts as its manifest's
    loss curve did; such a model is never saved.
    """
    if stop_after is not None and (save or stop_after < 1):
        raise ValueError(f"stop_after trains part of a recipe, at least one step, and is never saved (save=False); "
                         f"got stop_after={stop_after}, save={save}")
    family = toy_family(family)
    train = train or toy_recipe(family)
    fam = families()[family]
    tokenizer = word_tokenizer()
    config = toy_config(family, len(tokenizer), arch)
    start, cpu_start = time.perf_counter(), time.process_time()
    progress(f"drawing {train.steps * train.batch_size} training prompts")
    ids, answers = _drawn(train.steps * train.batch_size, seed, data)
    target_ids = {o: option_ids(tokenizer, o)[0] for o in OPTIONS}
    targets = torch.tensor([target_ids[a] for a in answers])
    batches = _batches([len(x) for x in ids], train.batch_size, random.Random(seed + 1))
    while len(batches) < train.steps:  # a remainder dropped by pooling: recycle from the start
        batches.append(batches[len(batches) - train.steps])

    with _torch_threads(train.threads):
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = getattr(transformers, fam.causal_lm_class)(config).to(torch.float32)
        progress(f"training {train.steps} steps" + (f", stopping after {stop_after}" if stop_after else ""))
        curve = _fit(model, ids, targets, batches, train, on_step, stop_after)
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
        "data": asdict(data), "train": asdict(train), "arch": toy_arch(family, arch),
        "n_params": sum(p.numel() for p in model.parameters()), "n_train_prompts": len(ids),
        "mean_prompt_tokens": round(sum(len(x) for x in ids) / len(ids), 1),
        "train_wall_s": round(train_s, 1), "train_cpu_s": round(train_cpu_s, 1), "eval_wall_s": round(eval_s, 1),
        "loss_curve": curve, "final_loss": curve[-1][1], **({"stopped_after": stop_after} if stop_after else {}),
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


def save_toy(model, tokenizer, manifest: dict, folder: Path) -> tuple[Path, list[Path]]:
    """Write the HF folder and manifest to a temporary folder, then rename it into place."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / TOY_MANIFEST).write_text(json_text(manifest))
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
