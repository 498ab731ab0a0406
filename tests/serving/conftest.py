"""Fixtures for the serving tests that need no vLLM: a byte-level tokenizer built here, and a
stand-in OpenAI-compatible server with a prefix cache of its own (a test double, not a benchmark
target: completions answer with a hash of the prompt, chat completions with a given rule, and it
counts hits the way vLLM's cache does)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

MODEL = "smollm2-135m"


def make_byte_tokenizer(chat_template: str | None = None):
    """One token per byte (no merges): prompts of a known, exact length."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    out = PreTrainedTokenizerFast(tokenizer_object=tok)
    if chat_template:
        out.chat_template = chat_template
    return out


@pytest.fixture(scope="session")
def byte_tokenizer():
    """The byte tokenizer, no chat template."""
    return make_byte_tokenizer()


class FakeVllm:
    """An OpenAI-compatible server on 127.0.0.1 with vLLM's metric names and block-granular caching.

    ``die_after``: close the listening socket after that many completions (a server that dies).
    ``tokenizer`` (with a chat template) and ``decide`` (prompt text -> option) serve chat
    completions: the messages through the template, the answer's first token with top logprobs as
    token ids, as vLLM streams them (tests/data/serving/vllm_chat_stream.json is a recorded one).
    """

    def __init__(self, block: int = 32, die_after: int | None = None, tokenizer=None, decide=None):
        self.block, self.die_after = block, die_after
        self.tokenizer, self.decide = tokenizer, decide
        self.blocks: set[tuple] = set()
        self.queries = self.hits = 0
        self.completions = 0
        self.bodies: list[dict] = []  # every completion request's JSON body, as received
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

            def _chat(self, body):
                tok = fake.tokenizer
                text = tok.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
                prompt = tok(text, add_special_tokens=False)["input_ids"]
                cached = fake.prefill(prompt)
                answer = fake.decide(text)
                other = "no" if answer == "yes" else "yes"
                first = {o: tok.encode(o, add_special_tokens=False)[0] for o in (answer, other)}
                top = [{"token": f"token_id:{first[answer]}", "logprob": -0.1},
                       {"token": f"token_id:{first[other]}", "logprob": -2.4}]
                head = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": MODEL}
                chunk = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": answer},
                                              "logprobs": {"content": [{"token": top[0]["token"], "logprob": -0.1,
                                                                        "top_logprobs": top}]}}]}
                usage = {"prompt_tokens": len(prompt), "completion_tokens": 1, "total_tokens": len(prompt) + 1,
                         "prompt_tokens_details": {"cached_tokens": cached}}
                self._stream([chunk, {**head, "choices": [], "usage": usage}])

            def _stream(self, events: list[dict]) -> None:
                """Server-sent events as vLLM streams them: each event, then [DONE]."""
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                for event in events:
                    self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path.endswith("/chat/completions"):
                    self._chat(body)
                else:
                    self._completion(body)
                with fake.lock:
                    fake.completions += 1
                    if fake.die_after is not None and fake.completions >= fake.die_after:
                        threading.Thread(target=fake.close, daemon=True).start()

            def _completion(self, body):
                with fake.lock:
                    fake.bodies.append(body)
                prompt = body["prompt"]
                cached = fake.prefill(prompt)
                answer = " yes" if sum(prompt) % 2 == 0 else " no"
                usage = {"prompt_tokens": len(prompt), "completion_tokens": 2, "total_tokens": len(prompt) + 2,
                         "prompt_tokens_details": {"cached_tokens": cached}}
                self._stream([*({"choices": [{"index": 0, "text": text}]} for text in (answer, ".")),
                              {"choices": [], "usage": usage}])

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


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="session")
def chat_byte_tokenizer():
    """The byte tokenizer with a small chat template (a prompt state renders chat messages)."""
    return make_byte_tokenizer(CHAT_TEMPLATE)


@pytest.fixture
def byte_bench(monkeypatch, byte_tokenizer):
    """Make the benchmark tokenize with the byte tokenizer (no model download)."""
    from kvprobe.serving import bench

    monkeypatch.setattr(bench, "load_tokenizer", lambda model: byte_tokenizer)
    return bench
