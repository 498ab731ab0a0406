"""Field-edit cases: schema, generator, prompt rendering, token alignment and JSONL io."""

from kvprobe.datasets.domains import CONTROL_FIELDS, DOMAINS, DecisionField, DomainSpec, Template
from kvprobe.datasets.generate import (ERRATUM, ERRATUM_TEMPLATES, SHORT_ERRATUM, erratum_text, generate,
                                      vocabulary)
from kvprobe.datasets.io import load_jsonl, require_answers, resolve_dataset, save_jsonl
from kvprobe.datasets.render import RenderedPrompt, render_body, render_pair, render_prompt
from kvprobe.datasets.schema import POSITIONS, Demo, EditCase
from kvprobe.datasets.spans import KINDS, AlignedCase, Skip, align

__all__ = [
    "CONTROL_FIELDS",
    "DOMAINS",
    "ERRATUM",
    "ERRATUM_TEMPLATES",
    "KINDS",
    "POSITIONS",
    "SHORT_ERRATUM",
    "AlignedCase",
    "DecisionField",
    "Demo",
    "DomainSpec",
    "EditCase",
    "RenderedPrompt",
    "Skip",
    "Template",
    "align",
    "erratum_text",
    "generate",
    "load_jsonl",
    "render_body",
    "render_pair",
    "render_prompt",
    "require_answers",
    "resolve_dataset",
    "save_jsonl",
    "vocabulary",
]
