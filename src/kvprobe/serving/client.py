"""kvprobe's side of an OpenAI-compatible server, through the official ``openai`` client: streamed
completions (token ids) and chat completions (messages, with the first token's top logprobs),
timed; the model list; and, with ``httpx`` (the client's own transport), vLLM's ``/metrics`` and
``/version``.

Prompts of the single-field benchmark go as token ids, so the server prefills exactly the tokens
the ceiling was computed on; the agent workload sends chat messages, as a deployed agent does, and
asks for the logprobs of the first answer token as token ids (vLLM's ``return_tokens_as_token_ids``),
so that the decision is read from the options' scores, as kvprobe reads it from logits.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import httpx
import openai

from kvprobe.errors import EnvironmentProblem, KvprobeError, UsageError

REQUEST_TIMEOUT_S = 300.0
TOP_LOGPROBS = 20  # vLLM's default --max-logprobs


class ServerGone(KvprobeError):
    """The server stopped answering (refused, reset, or timed out) in the middle of a run."""


@dataclass
class Completion:
    """One streamed completion, timed from the moment its request was sent."""

    text: str = ""
    ttft_s: float = float("nan")  # to the first streamed chunk that carries a token
    latency_s: float = float("nan")  # to the end of the stream
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # None: the server did not report it
    top_logprobs: dict[int, float] = field(default_factory=dict)  # the first token's, by token id (chat only)
    error: str | None = None
    server_gone: bool = False


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port[/v1]`` -> ``http://host:port`` (a one-line error otherwise)."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError):
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise UsageError(f"bad server URL {url!r}; give http://HOST:PORT of an OpenAI-compatible vLLM server")
    path = parsed.path.removesuffix("/v1").rstrip("/")
    return str(parsed.copy_with(path=path or "", query=None, fragment=None)).rstrip("/")


@functools.lru_cache(maxsize=8)
def client(url: str, timeout: float = REQUEST_TIMEOUT_S) -> openai.OpenAI:
    """One ``openai`` client per server (thread-safe; its connection pool is shared by the requests
    a run sends together). No retries: a failed request is a measurement, not something to hide."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=timeout)


@functools.lru_cache(maxsize=1)
def _http() -> httpx.Client:
    """One ``httpx`` client for the plain GETs (``/metrics``, ``/version``; thread-safe, its connections
    kept). ``httpx.get`` builds a client, and with it a TLS context, per call: 24.5 against 3.0 ms of CPU
    a request on a Zen 4, and serve-bench reads ``/metrics`` around every request it times."""
    return httpx.Client()


def get_text(url: str, timeout: float = 10.0) -> str:
    r = _http().get(url, timeout=timeout)
    r.raise_for_status()
    return r.text


def get_json(url: str, timeout: float = 10.0) -> dict:
    try:
        return _http().get(url, timeout=timeout).raise_for_status().json()
    except (httpx.HTTPError, ValueError) as exc:
        raise OSError(str(exc)) from None


def served_models(url: str, timeout: float = 10.0) -> list[str]:
    """The model ids the server serves; a one-line error when it cannot be reached."""
    try:
        return [m.id for m in client(url).with_options(timeout=timeout).models.list().data if m.id]
    except (openai.APIError, httpx.HTTPError, ValueError) as exc:
        reason = str(exc.__cause__ or exc) or type(exc).__name__  # the transport's words: "Connection refused"
        raise EnvironmentProblem(f"cannot reach an OpenAI-compatible server at {url} ({reason}); check --url, "
                                 f"or leave it out to use kvprobe's own server") from None


def scrape_metrics(url: str, timeout: float = 10.0) -> str:
    try:
        return get_text(f"{url}/metrics", timeout)
    except httpx.HTTPError as exc:
        raise ServerGone(f"cannot read {url}/metrics: {exc or type(exc).__name__}") from None


def _usage(out: Completion, usage) -> None:
    if usage is None:
        return
    out.prompt_tokens, out.completion_tokens = usage.prompt_tokens, usage.completion_tokens
    details = getattr(usage, "prompt_tokens_details", None)
    if details is not None and details.cached_tokens is not None:
        out.cached_tokens = int(details.cached_tokens)


def token_id(token: str) -> int | None:
    """``"token_id:9693"`` (vLLM's ``return_tokens_as_token_ids``) -> 9693; None for other forms."""
    head, _, tail = token.partition(":")
    return int(tail) if head == "token_id" and tail.isdigit() else None


def read_chat_stream(chunks: Iterable, out: Completion, t0: float) -> Completion:
    """Fill ``out`` from a chat completion stream: the text, the first token's top logprobs (by
    token id), the usage, and the time to the first chunk that carries a token."""
    pieces = []
    for chunk in chunks:
        for choice in chunk.choices or ():
            content = choice.delta.content if choice.delta is not None else None
            lp = choice.logprobs.content if choice.logprobs is not None else None
            if (content or lp) and math.isnan(out.ttft_s):
                out.ttft_s = time.perf_counter() - t0
            if lp and not out.top_logprobs:
                out.top_logprobs = {i: t.logprob for t in lp[0].top_logprobs
                                    if (i := token_id(t.token)) is not None and math.isfinite(t.logprob)}
            pieces.append(content or "")
        _usage(out, chunk.usage)
    out.text = "".join(pieces)
    out.latency_s = time.perf_counter() - t0
    return out


def _guard(send, out: Completion) -> Completion:
    """Run ``send`` (which fills ``out``); errors are recorded in ``out``, never raised."""
    try:
        send()
    except openai.APIConnectionError as exc:  # refused, reset, timed out (APITimeoutError is one)
        out.error = f"{type(exc).__name__}: {exc.__cause__ or exc}"
        out.server_gone = True
    except openai.APIStatusError as exc:
        out.error = f"HTTP {exc.status_code}: {' '.join(str(exc.message).split())[:300]}"
    except (httpx.HTTPError, OSError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        out.server_gone = True
    except (ValueError, KeyError, AttributeError) as exc:
        out.error = f"bad stream chunk: {exc}"
    return out


def stream_completion(url: str, model: str, prompt: list[int], max_tokens: int = 4,
                      timeout: float = REQUEST_TIMEOUT_S) -> Completion:
    """Send one greedy streamed completion of token ids and time it; errors are recorded, not raised."""
    out = Completion()
    t0 = time.perf_counter()

    def send():
        # The ids travel in ``extra_body`` (sent as given), not as ``prompt=``: the client's request
        # transform walks a list of ids one id at a time, 13.8 ms for 1500 ids on a Zen 4, inside the
        # time to the first token measured here; either way the server gets the same JSON list.
        stream = client(url).with_options(timeout=timeout).completions.create(
            model=model, prompt="", extra_body={"prompt": list(prompt)}, max_tokens=max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True})
        pieces = []
        for chunk in stream:
            if chunk.choices:
                if math.isnan(out.ttft_s):
                    out.ttft_s = time.perf_counter() - t0
                pieces.append(chunk.choices[0].text or "")
            _usage(out, chunk.usage)
        out.text = "".join(pieces)
        out.latency_s = time.perf_counter() - t0

    return _guard(send, out)


def stream_chat(url: str, model: str, messages: list[dict[str, str]], max_tokens: int = 1,
                top_logprobs: int = TOP_LOGPROBS, timeout: float = REQUEST_TIMEOUT_S) -> Completion:
    """Send one greedy streamed chat completion and time it, with the first token's ``top_logprobs``
    most likely tokens (as token ids); errors are recorded, not raised."""
    out = Completion()
    t0 = time.perf_counter()

    def send():
        stream = client(url).with_options(timeout=timeout).chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
            logprobs=True, top_logprobs=top_logprobs, stream_options={"include_usage": True},
            extra_body={"return_tokens_as_token_ids": True})
        read_chat_stream(stream, out, t0)

    return _guard(send, out)


def decide(top_logprobs: dict[int, float], option_ids: dict[str, list[int]]) -> tuple[str, dict[str, float]]:
    """The option with the highest score, an option's score being the largest logprob among its
    first-token ids (kvprobe's rule on logits: :func:`kvprobe.kv.readout.option_scores`). An option
    none of whose ids is in the top logprobs scores below every listed token; with neither option
    listed the decision is "?"."""
    scores = {o: max((top_logprobs[i] for i in ids if i in top_logprobs), default=-math.inf)
              for o, ids in option_ids.items()}
    best = max(scores, key=scores.get)
    return ("?" if scores[best] == -math.inf else best), scores
