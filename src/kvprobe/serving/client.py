"""A small OpenAI-compatible client (standard library only): streamed completions with timing,
the model list and the Prometheus metrics. Prompts go as token ids, so the server prefills
exactly the tokens the ceiling was computed on.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from kvprobe.errors import EnvironmentProblem, KvprobeError, UsageError

REQUEST_TIMEOUT_S = 300.0


class ServerGone(KvprobeError):
    """The server stopped answering (refused, reset, or timed out) in the middle of a run."""


@dataclass
class Completion:
    """One streamed completion, timed from the moment its request was sent."""

    text: str = ""
    ttft_s: float = float("nan")  # to the first streamed chunk that carries a choice
    latency_s: float = float("nan")  # to the end of the stream
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # None: the server did not report it
    error: str | None = None
    server_gone: bool = False


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port[/v1]`` -> ``http://host:port`` (a one-line error otherwise)."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise UsageError(f"bad server URL {url!r}; give http://HOST:PORT of an OpenAI-compatible vLLM server")
    path = parsed.path.removesuffix("/v1").rstrip("/")
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, path, "", ""))


def _get(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode("utf-8", errors="replace")


def get_json(url: str, timeout: float = 10.0) -> dict:
    return json.loads(_get(url, timeout))


def served_models(url: str, timeout: float = 10.0) -> list[str]:
    """The model ids the server serves; a one-line error when it cannot be reached."""
    try:
        data = get_json(f"{url}/v1/models", timeout)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise EnvironmentProblem(f"cannot reach an OpenAI-compatible server at {url} ({reason}); check --url, "
                                 f"or leave it out to use kvprobe's own server") from None
    return [m.get("id") for m in data.get("data", []) if m.get("id")]


def scrape_metrics(url: str, timeout: float = 10.0) -> str:
    try:
        return _get(f"{url}/metrics", timeout)
    except (urllib.error.URLError, OSError) as exc:
        raise ServerGone(f"cannot read {url}/metrics: {getattr(exc, 'reason', None) or exc}") from None


def stream_completion(url: str, model: str, prompt: list[int], max_tokens: int = 4,
                      timeout: float = REQUEST_TIMEOUT_S) -> Completion:
    """Send one greedy streamed completion and time it; errors are recorded, not raised."""
    parsed = urllib.parse.urlsplit(url)
    conn_cls = http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "stream": True, "stream_options": {"include_usage": True}})
    out = Completion()
    t0 = time.perf_counter()
    conn = conn_cls(parsed.hostname, parsed.port, timeout=timeout)
    try:
        conn.request("POST", f"{parsed.path}/v1/completions", body=body,
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        resp = conn.getresponse()
        if resp.status != 200:
            detail = resp.read().decode("utf-8", errors="replace")[:300]
            out.error = f"HTTP {resp.status}: {' '.join(detail.split())}"
            return out
        pieces = []
        for raw in resp:
            line = raw.decode("utf-8", errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("choices"):
                if out.ttft_s != out.ttft_s:  # NaN: the first token
                    out.ttft_s = time.perf_counter() - t0
                pieces.append(chunk["choices"][0].get("text") or "")
            usage = chunk.get("usage")
            if usage:
                out.prompt_tokens = usage.get("prompt_tokens")
                out.completion_tokens = usage.get("completion_tokens")
                details = usage.get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    out.cached_tokens = int(details["cached_tokens"])
        out.text = "".join(pieces)
        out.latency_s = time.perf_counter() - t0
    except (ConnectionError, TimeoutError, OSError, http.client.HTTPException) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        out.server_gone = True
    except json.JSONDecodeError as exc:
        out.error = f"bad stream chunk: {exc}"
    finally:
        conn.close()
    return out
