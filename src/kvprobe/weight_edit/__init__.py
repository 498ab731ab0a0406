"""Weight edits beside the KV repairs: a LoRA (through peft) fitted per edit so that the stale prompt
gives the oracle's decision, measured against the KV editor's strategies on the same cases for
agreement, time to the edited decision and contamination of other requests (docs/weight-edit.md).

    with lora_adapter(lm, LoraSettings(rank=8)) as (wrapped, setup_s):   # unloaded on exit
        result = fit(lm, wrapped, ids_old, option_ids, options, target, target_token, settings)

:mod:`.lora` holds the mechanics (wrap, fit, read, unload), :mod:`.runner` the per-case rows and
the resumable loop over cases. ``peft`` is an extra: ``pip install 'kvprobe[weight-edit]'``.
"""

from kvprobe.weight_edit.lora import LoraSettings, decisions, fit, lora_adapter, require_peft, target_modules
from kvprobe.weight_edit.runner import (DEFAULT_CONTAMINATION_CASES, DEFAULT_KV_STRATEGIES, WEIGHT_COLUMNS,
                                        run_weight_edits, summarize_weight_edits, weight_edit_case)

__all__ = ["DEFAULT_CONTAMINATION_CASES", "DEFAULT_KV_STRATEGIES", "WEIGHT_COLUMNS", "LoraSettings", "decisions", "fit",
           "lora_adapter", "require_peft", "run_weight_edits", "summarize_weight_edits", "target_modules",
           "weight_edit_case"]
