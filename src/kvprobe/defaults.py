"""Defaults that the command line shows in its help and the run configuration uses: one home,
importable without torch (``kvprobe --help`` must not load a model stack)."""

DEFAULT_MODEL = "toy-qwen2"  # the bundled default: ships in the package, decides by the field
DEFAULT_N = 40  # kvprobe edit and datasets check; kvprobe run sizes itself (RunConfig.sizing)
DEFAULT_BUDGET = 600  # a sized run's most cases
DEFAULT_THRESHOLD = 0.95  # what a run's repair, K* and topk.yaml are established at
MIN_THRESHOLD = 0.5  # below it a repair that disagrees with the oracle more often than not could be "established"
THRESHOLD_RANGE = f"a number in [{MIN_THRESHOLD:g}, 1)"  # every repair threshold: options, configs, policy files
DEFAULT_MIN_FLIP = 1.0  # logits: a case whose oracle flip is smaller gets no recovery ratio
FORMS = ("auto", "chat", "raw")  # how a case becomes a prompt (see kvprobe.datasets.render)
DEFAULT_FORM = "auto"  # chat where the tokenizer has a template, else raw

# the strategies a run or an edit uses unless told otherwise (specs of kvprobe.editor.strategies)
DEFAULT_STRATEGIES = ("stale", "field_only", "selective:8:attention", "selective:8:random", "cacheblend:0.15",
                      "erratum", "field_erratum", "hoist", "oracle")
# kvprobe diagnose: every strategy that runs on a user's prompt (auto and oracle are added)
DIAGNOSE_STRATEGIES = ("stale", "field_only", "selective:8:attention", "cacheblend:0.15", "erratum", "field_erratum",
                       "erratum_turn", "field_erratum_turn", "auto", "oracle")
# kvprobe sweep: the grid and the strategies measured per cell
SWEEP_LAYOUTS = ("record", "lines", "json")
SWEEP_FILLER_TOKENS = (0, 100, 300)
SWEEP_STRATEGIES = ("stale", "field_only", "erratum", "erratum_turn", "field_erratum", "field_erratum_turn",
                    "cacheblend:0.15", "oracle")
LAYOUT_NAMES = ("record", "lines", "prose", "json", "yaml", "chat_history", "tool_spec")  # datasets.layouts.LAYOUTS


def is_threshold(value) -> bool:
    """Whether ``value`` is a repair threshold (:data:`THRESHOLD_RANGE`): the lower bound of a repair's
    agreement with the oracle that establishes it, for ``kvprobe run``, ``export-topk``, ``compare``,
    ``calibrate`` and ``memory``, a run config, a topk.yaml and a field_policy.yaml alike."""
    import math

    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and MIN_THRESHOLD <= value < 1)


def checked_form(form: str) -> str:
    """``form`` when it is one of :data:`FORMS`; a ValueError naming them otherwise (config validators)."""
    if form not in FORMS:
        raise ValueError(f"unknown prompt form {form!r}; accepted: {', '.join(FORMS)}")
    return form
# the composition gate (kvprobe validate, and the report's headline for a run with --compose)
GATE_SEAM = 4  # seam-repair width gated on
GATE_THRESHOLD = 0.9  # minimum re-rotated agreement with a full prefill there
