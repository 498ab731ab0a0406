"""Pure arithmetic of the serving benchmark: arrival schedules, Prometheus text, hit rates, the
block-granularity ceiling, percentiles and the per-run summary. No network, no server.

Hit rate, two ways that must agree::

    metrics   (hits_after - hits_before) / (queries_after - queries_before)
              of vllm:prefix_cache_hits_total and vllm:prefix_cache_queries_total (tokens)
    usage     sum(usage.prompt_tokens_details.cached_tokens) / sum(usage.prompt_tokens)

Ceiling: the prefix cache hands out whole blocks, and never the prompt's last token (its logits
must be computed), so a request of P tokens can hit at most ``B * floor((P - 1) / B)`` tokens, and
only the leading blocks that an earlier request already filled (:class:`BlockCeiling`). The
per-request ceiling follows the send order; requests sent together may reach the engine in another
order, so compare sums over a run (a run's ceiling), not single requests. The ceiling knows only
what this benchmark sent: a warm server that served the same prompts before (the base prompt, the
small value set) can beat it; unique values never repeat across benchmarks (their salt).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd

from kvprobe.errors import EnvironmentProblem, UsageError

QUERIES = "vllm:prefix_cache_queries"
HITS = "vllm:prefix_cache_hits"
CACHE_INFO = "vllm:cache_config_info"
AGREE_TOL = 0.02  # |metrics - usage| hit rates further apart than this do not agree
SATURATION = math.inf  # the rate that sends every request at once



# -- load ------------------------------------------------------------------------------------------
def parse_rates(text: str) -> list[float]:
    """``"0.5,1,2,inf"`` -> [0.5, 1.0, 2.0, inf]; positive rates, ``inf`` (or ``sat``) for saturation."""
    rates = []
    for part in (p.strip().lower() for p in text.split(",")):
        if not part:
            continue
        try:
            rate = SATURATION if part in ("inf", "sat", "saturation") else float(part)
        except ValueError:
            rate = float("nan")
        if not rate > 0:
            raise UsageError(f"bad rate {part!r} in {text!r}; give positive requests per second, "
                             f"comma-separated, and 'inf' for saturation (e.g. 0.5,1,2,inf)")
        rates.append(rate)
    if not rates:
        raise UsageError(f"no rate in {text!r}; e.g. 0.5,1,2,inf")
    return sorted(set(rates))


def check_rates(rates: list[float]) -> list[float]:
    """A configuration's rates, validated and in ascending order (pydantic raises the ValueError)."""
    if not rates or any(not r > 0 for r in rates):
        raise ValueError("rates must be positive (inf for saturation)")
    return sorted(set(rates))


def check_arms(arms: list[str], accepted: tuple[str, ...], always: tuple[str, ...] = ()) -> list[str]:
    """A configuration's arms in the canonical order of ``accepted``, with ``always`` added."""
    bad = [a for a in arms if a not in accepted]
    if bad or not arms:
        raise ValueError(f"unknown arm(s) {bad or '(none given)'}; accepted: {', '.join(accepted)}")
    return [a for a in accepted if a in arms or a in always]


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def poisson_schedule(rate: float, n: int, seed: int = 0) -> list[float]:
    """Send offsets (seconds from the run's start) of ``n`` Poisson arrivals at ``rate`` per second.

    The first request goes at 0; the gaps are exponential with mean 1 / rate. At saturation
    (``rate`` = inf) every request goes at 0.
    """
    if n < 0 or not rate > 0:
        raise UsageError(f"a schedule needs n >= 0 and a positive rate, got n={n}, rate={rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"poisson:{seed}:{rate!r}")
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


# -- Prometheus text -------------------------------------------------------------------------------
def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of Prometheus text exposition, parsed by ``prometheus_client``: (name, labels, value).
    Text that is not Prometheus exposition is a one-line error (the server is not the vLLM asked for)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        return [(s.name, dict(s.labels), float(s.value))
                for family in text_string_to_metric_families(text) for s in family.samples]
    except (ValueError, TypeError, IndexError) as exc:
        raise EnvironmentProblem(f"the server's /metrics is not Prometheus text ({exc}); is it a vLLM server?") \
            from None


def counter(samples, name: str) -> float | None:
    """A counter's value summed over its label sets (``name`` with or without ``_total``); None if absent."""
    names = {name, name.removesuffix("_total") + "_total"}
    values = [v for n, _, v in samples if n in names]
    return float(sum(values)) if values else None


def block_size_of(samples) -> int | None:
    """The server's KV block size, from vLLM's ``cache_config_info`` labels, if it exposes it."""
    for n, labels, _ in samples:
        if n == CACHE_INFO and labels.get("block_size", "").isdigit():
            return int(labels["block_size"])
    return None


def hit_rate(hits: float | None, queries: float | None) -> float:
    """hits / queries, NaN when either is unknown or nothing was queried."""
    if hits is None or queries is None or not queries > 0:
        return float("nan")
    return float(hits) / float(queries)


def metrics_delta(before, after) -> tuple[float | None, float | None]:
    """(queries, hits) counted between two scrapes; None where the server lacks the counter.

    A counter that went down means the server restarted in between: a one-line error.
    """
    out = []
    for name in (QUERIES, HITS):
        a, b = counter(before, name), counter(after, name)
        if a is None or b is None:
            out.append(None)
            continue
        if b < a:
            raise EnvironmentProblem(f"{name} went down from {a:g} to {b:g}: the server restarted during the run")
        out.append(b - a)
    return out[0], out[1]


# -- the block-granularity ceiling -----------------------------------------------------------------
class BlockCeiling:
    """What an unbounded prefix cache of ``block``-token blocks could serve, request by request.

    :meth:`add` returns the tokens of ``ids`` that earlier requests' full blocks cover (leading
    blocks only, at most ``floor((len - 1) / block)`` of them), then records ``ids``' own full
    blocks. Blocks are keyed by their whole prefix, as vLLM chains its block hashes.
    """

    def __init__(self, block: int):
        if block < 1:
            raise UsageError(f"block size must be >= 1, got {block}")
        self.block = block
        self.seen: set[int] = set()

    def _keys(self, ids: Sequence[int]) -> list[int]:
        keys, h = [], 0
        for start in range(0, len(ids) - self.block + 1, self.block):
            h = hash((h, tuple(ids[start:start + self.block])))
            keys.append(h)
        return keys

    def add(self, ids: Sequence[int]) -> int:
        keys = self._keys(ids)
        usable = max(0, (len(ids) - 1) // self.block)
        hit = 0
        for k in keys[:usable]:
            if k not in self.seen:
                break
            hit += 1
        self.seen.update(keys)
        return hit * self.block


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def static_ceiling(shared: int, prompt_tokens: float, block: int) -> float:
    """The hit-rate ceiling of a prompt whose first ``shared`` tokens are in the cache."""
    if not prompt_tokens > 0:
        return float("nan")
    usable = min(shared, int(prompt_tokens) - 1)
    return block * max(0, usable // block) / prompt_tokens


# -- summaries -------------------------------------------------------------------------------------
def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (linear interpolation) of the finite values; NaN when there are none."""
    arr = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    return float(np.percentile(arr, q)) if arr.size else float("nan")


SUMMARY_KEYS = ("rate", "arm")


def summarize(df: pd.DataFrame, usage_reported: bool | None = None) -> pd.DataFrame:
    """One row per (rate, arm): counts, both hit rates and whether they agree, the ceiling, TTFT
    percentiles, throughput and decision agreement with the oracle (``distinct_references``: how many
    distinct answers the oracle gave; with one, agreement cannot tell a right arm from a stuck one).

    ``usage_reported``: whether the server reports cached tokens per request at all (default: some
    row of ``df`` has them); when it does not, the usage hit rate is NaN rather than 0.
    """
    if df.empty:
        return pd.DataFrame()
    if usage_reported is None:
        usage_reported = bool(df["cached_reported"].any()) if "cached_reported" in df else True
    rows = []
    for (rate, arm), g in df.groupby(list(SUMMARY_KEYS), sort=True):
        ok = g[g["ok"].astype(bool)]
        prompt = float(ok["prompt_tokens"].sum())
        usage = float(ok["cached_tokens"].fillna(0).sum()) / prompt if usage_reported and prompt > 0 else float("nan")
        q, h = g["run_queries"].iloc[0], g["run_hits"].iloc[0]
        metrics = hit_rate(None if pd.isna(h) else h, None if pd.isna(q) else q)
        wall = float(g["run_wall_s"].iloc[0])
        agree = ok["agree"].dropna().astype(float)
        rows.append({
            "rate": float(rate), "arm": arm, "n": len(g), "ok": len(ok), "errors": int(len(g) - len(ok)),
            "prompt_tokens": float(ok["prompt_tokens"].mean()) if len(ok) else float("nan"),
            "hit_rate_metrics": metrics, "hit_rate_usage": usage,
            "hit_rates_agree": bool(abs(metrics - usage) <= AGREE_TOL) if math.isfinite(metrics) and
            math.isfinite(usage) else None,
            "ceiling": float(ok["ceiling_tokens"].sum()) / prompt if prompt > 0 else float("nan"),
            "ttft_p50": percentile(ok["ttft_s"], 50), "ttft_p90": percentile(ok["ttft_s"], 90),
            "ttft_p99": percentile(ok["ttft_s"], 99),
            "throughput": len(ok) / wall if wall > 0 else float("nan"),
            "agreement": float(agree.mean()) if len(agree) else float("nan"), "n_agreement": len(agree),
            "distinct_references": int(ok.loc[ok["reference"] != "?", "reference"].nunique())
            if "reference" in ok else 0,
        })
    return pd.DataFrame(rows)


def ratios(summary: pd.DataFrame, edit_arm: str = "edit_unique") -> pd.DataFrame:
    """Per rate, erratum against the in-prefix edit: TTFT p50/p90 (edit / erratum, >1: erratum
    faster) and throughput (erratum / edit)."""
    rows = []
    for rate, g in summary.groupby("rate", sort=True):
        e, x = g[g["arm"] == "erratum"], g[g["arm"] == edit_arm]
        if e.empty or x.empty:
            continue
        e, x = e.iloc[0], x.iloc[0]
        rows.append({"rate": float(rate), "edit_arm": edit_arm,
                     "ttft_p50_ratio": _ratio(x["ttft_p50"], e["ttft_p50"]),
                     "ttft_p90_ratio": _ratio(x["ttft_p90"], e["ttft_p90"]),
                     "throughput_ratio": _ratio(e["throughput"], x["throughput"]),
                     "hit_rate_erratum": e["hit_rate_metrics"], "hit_rate_edit": x["hit_rate_metrics"]})
    return pd.DataFrame(rows)


def _ratio(a: float, b: float) -> float:
    return float(a) / float(b) if math.isfinite(a) and math.isfinite(b) and b > 0 else float("nan")
