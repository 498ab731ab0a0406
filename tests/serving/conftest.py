"""Fixtures for the serving tests that need no vLLM: a byte-level tokenizer built here, and a
stand-in OpenAI-compatible server with a prefix cache of its own (a test double, not a benchmark
target: it answers with a hash of the prompt and counts hits the way vLLM's cache does)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

MODEL = "smollm2-135m"


@pytest.fixture(scope="session")
def byte_tokenizer():
    """One token per byte (no merges, no chat template): prompts of a known, exact length."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


class FakeVllm:
    """An OpenAI-compatible server on 127.0.0.1 with vLLM's metric names and block-granular caching.

    ``die_after``: close the listening socket after that many completions (a server that dies).
    """

    def __init__(self, block: int = 32, die_after: int | None = None):
        self.block, self.die_after = block, die_after
        self.blocks: set[tuple] = set()
        self.queries = self.hits = 0
        self.completions = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, code: int, body: str, ctype: str = "application/json") -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health":
                    self._send(200, "")
                elif self.path == "/v1/models":
                    self._send(200, json.dumps({"data": [{"id": MODEL}]}))
                elif self.path == "/version":
                    self._send(200, json.dumps({"version": "fake"}))
                elif self.path == "/metrics":
                    self._send(200, fake.metrics_text(), "text/plain")
                else:
                    self._send(404, "{}")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body["prompt"]
                cached = fake.prefill(prompt)
                answer = " yes" if sum(prompt) % 2 == 0 else " no"
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                for text in (answer, "."):
                    chunk = {"choices": [{"index": 0, "text": text}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                usage = {"prompt_tokens": len(prompt), "completion_tokens": 2, "total_tokens": len(prompt) + 2,
                         "prompt_tokens_details": {"cached_tokens": cached}}
                self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                with fake.lock:
                    fake.completions += 1
                    if fake.die_after is not None and fake.completions >= fake.die_after:
                        threading.Thread(target=fake.close, daemon=True).start()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def prefill(self, ids: list[int]) -> int:
        """Leading full blocks already seen (never the last token), then remember this prompt's blocks."""
        keys = [tuple(ids[: end]) for end in range(self.block, len(ids) + 1, self.block)]
        usable = (len(ids) - 1) // self.block
        with self.lock:
            hit = 0
            while hit < usable and keys[hit] in self.blocks:
                hit += 1
            self.blocks.update(keys)
            self.queries += len(ids)
            self.hits += hit * self.block
        return hit * self.block

    def metrics_text(self) -> str:
        return (f"# HELP vllm:prefix_cache_queries_total Prefix cache queries, in tokens.\n"
                f"# TYPE vllm:prefix_cache_queries_total counter\n"
                f'vllm:prefix_cache_queries_total{{engine="0",model_name="{MODEL}"}} {float(self.queries)}\n'
                f'vllm:prefix_cache_hits_total{{engine="0",model_name="{MODEL}"}} {float(self.hits)}\n'
                f'vllm:cache_config_info{{block_size="{self.block}",enable_prefix_caching="True",engine="0"}} 1.0\n')

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_vllm():
    servers = []

    def make(**kw) -> FakeVllm:
        servers.append(FakeVllm(**kw))
        return servers[-1]

    yield make
    for s in servers:
        try:
            s.close()
        except OSError:
            pass


@pytest.fixture
def byte_bench(monkeypatch, byte_tokenizer):
    """Make the benchmark tokenize with the byte tokenizer (no model download)."""
    from kvprobe.serving import bench

    monkeypatch.setattr(bench, "load_tokenizer", lambda model: byte_tokenizer)
    return bench
