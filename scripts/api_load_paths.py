"""The same edit through every way of loading a model: the largest decision-logit difference from
the spec path (docs/api.md, "Loading a model").

    python scripts/api_load_paths.py

smollm2-135m by spec, from its folder with transformers, and wrapped by nnsight, under eager and
sdpa attention; stale, field_only, erratum_turn and oracle on one generated decision case.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import nnsight
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvprobe
from kvprobe.datasets import generate
from kvprobe.models import fetch

sys.path.insert(0, str(Path(__file__).parents[1]))
from tests.unit.test_api import context_of  # noqa: E402  (the test's context: the same prompt)


def main() -> None:
    case = next(c for c in generate(12, seed=3, controls=0.25) if not c.control)
    folder = fetch("smollm2-135m")
    for attn in ("eager", "sdpa"):
        spec = kvprobe.load("smollm2-135m", attn=attn)
        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrapped = nnsight.LanguageModel(model, tokenizer=tokenizer)
        for strategy in ("stale", "field_only", "erratum_turn", "oracle"):
            edit = {case.field: case.new_value}
            ref = context_of(spec, case).edit(strategy=strategy, **edit).logits
            diffs = [(context_of(lm, case).edit(strategy=strategy, **edit).logits - ref).abs().max().item()
                     for lm in (kvprobe.load(model, tokenizer), kvprobe.load(wrapped))]
            print(f"{attn:5s} {strategy:13s} transformers {diffs[0]:.2e}  nnsight {diffs[1]:.2e}")


if __name__ == "__main__":
    main()
