"""A LoRA weight edit of one decision case, through peft: the adapter is wrapped around the model's
attention projections, fitted on the stale prompt until the model gives the oracle's decision (or a
step budget runs out), read, and unloaded again, leaving the base weights as they were, bit for bit.

The loss is the cross-entropy, over the full vocabulary, of the oracle's answer token at the decision
position of the stale prompt (``ids_old[:D+1]``, the decision token fed last): the answer token is the
token of the oracle's decision (its arg-max option) that the oracle's own logits rank highest among
that option's first-token ids. The fit stops early once the arg-max option on the stale prompt is the
oracle's (the edited decision); every step is one forward and one backward over the whole prompt.

Contamination is what the adapter does to other requests served by the same weights: with the
adapter active, the decisions of other prompts (:func:`decisions`) are read again and those that
differ from the base model's are counted.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvprobe.errors import EnvironmentProblem, UsageError
from kvprobe.kv.readout import predicted

PROJECTIONS = ("q", "k", "v", "o")


def require_peft():
    """The ``peft`` module, or one line saying how to install it (exit 4)."""
    try:
        import peft
    except ImportError:
        raise EnvironmentProblem("kvprobe weight-edit needs peft, which is not installed here; install it with "
                                 "pip install 'kvprobe[weight-edit]'") from None
    return peft


@dataclass(frozen=True)
class LoraSettings:
    """How a LoRA edit is fitted: rank and alpha of the adapter on the attention projections named
    in ``targets`` (of q, k, v, o), Adam at ``lr`` for at most ``steps`` steps, stopping early once the
    edited decision is reached (``early_stop``). ``seed`` fixes the adapter's initial weights."""

    rank: int = 8
    alpha: float = 16.0
    lr: float = 1e-2
    steps: int = 50
    targets: tuple[str, ...] = PROJECTIONS
    early_stop: bool = True
    seed: int = 0

    def __post_init__(self):
        if self.rank < 1:
            raise UsageError(f"--lora-rank {self.rank}: give a rank of 1 or more")
        if self.steps < 1:
            raise UsageError(f"--steps {self.steps}: give 1 or more optimizer steps")
        if not self.lr > 0:
            raise UsageError(f"--lr {self.lr:g}: give a learning rate above 0")
        if not self.alpha > 0:
            raise UsageError(f"--lora-alpha {self.alpha:g}: give an alpha above 0")
        bad = [t for t in self.targets if t not in PROJECTIONS]
        if bad or not self.targets:
            raise UsageError(f"--lora-targets {','.join(self.targets) or '(none)'}: give some of "
                             f"{', '.join(PROJECTIONS)}")

    # what kvprobe.editor.score.score_row reads from a strategy
    k = None
    ranking = None

    @property
    def label(self) -> str:
        """The name of the LoRA rows: ``lora:r8``."""
        return f"lora:r{self.rank}"


def target_modules(lm, which: Sequence[str] = PROJECTIONS) -> list[str]:
    """The full module names of the attention projections ``which`` of every layer (the family
    adapter names them: kvprobe never spells them here)."""
    names = {id(m): n for n, m in lm.model.named_modules()}
    out = []
    for layer in range(lm.adapter.n_layers):
        for w in which:
            module = lm.adapter.proj(lm.model, layer, w)
            if not isinstance(module, torch.nn.Linear):
                raise UsageError(f"{lm.info.family}'s {w} projection is not a linear layer; a LoRA edit here "
                                 f"targets linear attention projections only")
            out.append(names[id(module)])
    return out


@contextlib.contextmanager
def lora_adapter(lm, settings: LoraSettings) -> Iterator[tuple[object, float]]:
    """Wrap ``lm.model`` in a fresh LoRA adapter (peft ``get_peft_model``; initial weights from
    ``settings.seed``) and yield (the peft model, the seconds the wrapping took). The adapter is
    unloaded in ``finally`` (peft ``unload``: the original modules put back, not merged) and every
    parameter's ``requires_grad`` is set back, so the base model is the one it was."""
    peft = require_peft()
    grad = {n: p.requires_grad for n, p in lm.model.named_parameters()}
    config = peft.LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=0.0, bias="none",
                             target_modules=target_modules(lm, settings.targets))
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        torch.manual_seed(settings.seed)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        wrapped = peft.get_peft_model(lm.model, config)
    setup_s = time.perf_counter() - start
    try:
        yield wrapped, setup_s
    finally:
        wrapped.unload()
        for n, p in lm.model.named_parameters():
            p.requires_grad_(grad[n])
        left = [n for n, _ in lm.model.named_modules() if "lora_" in n]
        assert not left, f"LoRA modules left after unload: {left[:3]}"


def prompt_logits(lm, ids: Sequence[int]) -> torch.Tensor:
    """The (V,) logits at the last position of a full forward of ``ids`` (a fresh prefill)."""
    out = lm.model(input_ids=torch.tensor([list(ids)], device=lm.device), logits_to_keep=1, use_cache=False)
    return out.logits[0, -1]


@torch.no_grad()
def decisions(lm, prompts: Sequence[tuple[Sequence[int], dict, list]]) -> list[str]:
    """The decision (arg-max option) of each prompt ``(ids up to and with the decision token,
    option_ids, options)`` under the model as it is now (with an adapter, if one is active)."""
    return [predicted(prompt_logits(lm, ids).float(), option_ids, options)[0] for ids, option_ids, options in prompts]


def answer_token(oracle_logits: torch.Tensor, option_ids: dict, answer: str) -> int:
    """The token of option ``answer`` that ``oracle_logits`` (V,) rank highest: the oracle's answer token."""
    ids = option_ids[answer]
    return int(ids[int(oracle_logits[torch.as_tensor(ids)].argmax())])


@dataclass
class Fit:
    """What a LoRA fit gave: the decision logits (V,) on the stale prompt after it, the optimizer
    steps taken, whether the decision reached the target, the loss at each read, and seconds: the
    optimizer's creation (``optimizer_s``), the fit up to the last read (``fit_s``) and that read
    (``decide_s``)."""

    logits: torch.Tensor
    steps: int
    reached: bool
    losses: list[float]
    optimizer_s: float
    fit_s: float
    decide_s: float


def fit(lm, wrapped, ids: Sequence[int], option_ids: dict, options: list[str], target: str, target_token: int,
        settings: LoraSettings) -> Fit:
    """Fit the adapter of ``wrapped`` so that the stale prompt ``ids`` (up to and with the decision
    token) gives the decision ``target``: cross-entropy of ``target_token`` at the last position, Adam.
    Each round reads the decision (one forward); it stops when the decision is ``target`` (with
    ``early_stop``) or after ``settings.steps`` steps, so the last read is the edited decision."""
    start = time.perf_counter()
    params = [p for p in wrapped.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=settings.lr)
    optimizer_s = time.perf_counter() - start
    losses: list[float] = []
    begin = time.perf_counter()
    with torch.enable_grad():
        for step in range(settings.steps + 1):
            read = time.perf_counter()
            logits = prompt_logits(lm, ids)
            decide_s = time.perf_counter() - read
            loss = F.cross_entropy(logits.float()[None], torch.tensor([target_token], device=logits.device))
            losses.append(float(loss.detach()))
            reached = predicted(logits.detach().float(), option_ids, options)[0] == target
            if (reached and settings.early_stop) or step == settings.steps:
                break
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    total = time.perf_counter() - begin
    return Fit(logits.detach().float(), step, reached, losses, optimizer_s, total - decide_s, decide_s)

