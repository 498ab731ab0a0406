"""llama.cpp as the engine whose cache kvprobe edits in place (llama-cpp-python's low-level API).

Why llama.cpp and not vLLM's KV connector (docs/serving.md, "Edited in the engine's cache"): the
repair is "recompute some positions of a cached prompt at their own positions, keep the rest", and
llama.cpp's memory API says exactly that. A sequence's cells can be removed by position range
(``llama_memory_seq_rm``), shared with another sequence by position range (``llama_memory_seq_cp``,
metadata only in a unified KV buffer) and new tokens decoded at given positions
(``llama_decode``). vLLM's v1 connector contract is a count of matched prefix tokens per request:
a repaired cache must be registered as a prefix match it is not, with the engine's own prefix cache
turned off or the blocks isolated, and its CPU build lays the cache out differently from CUDA's.
kvprobe's bundled models are GGUF files already, so the engine runs the same weights.

One context holds every session: a sequence per session, plus a scratch sequence for edits, in one
unified KV buffer (``kv_unified``), so sharing cells between sequences copies no data. llama.cpp
accepts a batch for a sequence only at the position after the sequence's last cell, so an edit is
built in the scratch sequence in position order:

    share [0, f0)              the cells before the first recomputed position, as they are
    decode the field           the new value's tokens at f0..f1-1: they attend to the prefix and to
                               each other, as kvprobe's field_only recomputes them
    share [f1, q), decode q    for a selective repair, each further position q in order: the kept
                               (stale) cells up to it, then q recomputed against them
    share the rest             the cells after the last recomputed position, unchanged
    swap                       the session's sequence is dropped and the scratch becomes it

which is kvprobe's ``recompute_positions`` (each recomputed token attends to the stale entries of
the positions before it and to the recomputed tokens before it), inside the engine's own cache.
Token ids come from the engine's own tokenizer; :func:`check_ids` holds them against kvprobe's.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvprobe.errors import EnvironmentProblem, KvprobeError, UsageError

INSTALL = "pip install -e '.[engine]' (builds llama-cpp-python from source: a few minutes; see the README)"
KV_TYPES = {"f16": 1, "f32": 0}  # GGML_TYPE_F16, GGML_TYPE_F32
ENGINE_DIR = "engine"  # under $KVPROBE_HOME: the float32 GGUFs of exactness checks


def llama_cpp():
    """The bindings module, or a one-line error saying how to install them."""
    try:
        import llama_cpp as module
    except ImportError:
        raise EnvironmentProblem(f"llama.cpp's Python bindings (llama-cpp-python) are not installed; {INSTALL}") \
            from None
    return module


_LOG: list[str] = []  # llama.cpp's latest error and info lines: its log callback is one per process
_ON_LOG = None  # the ctypes callback, kept for the life of the process (the C side holds only its pointer)


def _capture_log(lib) -> None:
    """Route llama.cpp's log into :data:`_LOG` (nothing printed), once per process."""
    global _ON_LOG
    if _ON_LOG is None:
        def on_log(level, text, user_data) -> None:
            if level in (2, 4):  # GGML_LOG_LEVEL_INFO (load failures say why there), _ERROR
                _LOG.append(text.decode(errors="replace").strip())
                del _LOG[:-20]

        _ON_LOG = lib.llama_log_callback(on_log)
        lib.llama_log_set(_ON_LOG, ctypes.c_void_p(0))


def _last_error() -> str:
    return next((e for e in reversed(_LOG) if e), "no message")


class InPlaceRefused(KvprobeError):
    """An edit the engine cannot make in place (the caller re-renders instead)."""


class Engine:
    """A llama.cpp model and context with ``sessions`` sequences and a scratch one.

    ``ids(s)`` is what session ``s`` holds, position by position; :meth:`serve` reuses the longest
    common prefix of what it holds (a per-session prefix cache); :meth:`edit` repairs positions in
    place; :meth:`read` feeds a tail, returns the last token's logits (V,) and takes the tail back.
    ``kv``: the cache's element type (llama.cpp's default ``f16``; ``f32`` for exactness checks);
    ``flash_attn``: None lets llama.cpp choose (on this CPU it takes its flash-attention kernel, which
    rounds through float16 even with a float32 cache: about 1e-2 on smollm2-135m's logits); False,
    with ``kv="f32"``, computes attention in float32 (2e-5 to 3e-5 from kvprobe's float32 reads);
    ``gpu_layers``: layers offloaded to a GPU (a CUDA build of llama-cpp-python; 0 on a CPU build).
    """

    def __init__(self, gguf: Path | str, *, n_ctx: int = 4096, sessions: int = 8, threads: int = 1,
                 kv: str = "f16", flash_attn: bool | None = None, gpu_layers: int = 0, n_batch: int = 512):
        lib = llama_cpp()
        if kv not in KV_TYPES:
            raise UsageError(f"bad KV cache type {kv!r}; accepted: {', '.join(KV_TYPES)}")
        gguf = Path(gguf)
        if not gguf.is_file():
            raise KvprobeError(f"no GGUF file at {gguf}")
        self.lib, self.path, self.sessions, self.n_batch = lib, gguf, sessions, n_batch
        _capture_log(lib)
        lib.llama_backend_init()
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = gpu_layers  # 0: the CPU; -1 or more than the model has: every layer (a CUDA build)
        self.model = lib.llama_model_load_from_file(str(gguf).encode(), mp)
        if not self.model:
            raise KvprobeError(f"llama.cpp could not load {gguf}: {_last_error()}")
        cp = lib.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_batch, n_batch
        cp.n_seq_max, cp.kv_unified, cp.swa_full = sessions + 1, True, True
        cp.type_k = cp.type_v = KV_TYPES[kv]
        cp.n_threads = cp.n_threads_batch = threads
        cp.no_perf = True
        cp.flash_attn_type = {None: -1, False: 0, True: 1}[flash_attn]  # llama.cpp: auto, disabled, enabled
        self.ctx = lib.llama_init_from_model(self.model, cp)
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise KvprobeError(f"llama.cpp could not make a context for {gguf}: {_last_error()}")
        self.n_ctx = lib.llama_n_ctx(self.ctx)
        self.mem = lib.llama_get_memory(self.ctx)
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)
        self.batch = lib.llama_batch_init(n_batch, 0, 1)
        self.scratch = sessions
        self._held: dict[int, list[int]] = {}

    # -- plumbing ---------------------------------------------------------------------------------
    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.lib.llama_model_free(self.model)
            self.ctx = None
            self._held.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def tokenize(self, text: str) -> list[int]:
        """The engine's token ids of ``text``: special tokens parsed (a chat template's own), none added."""
        self._live()
        data = text.encode()
        buf = (self.lib.llama_token * (len(data) + 8))()
        n = self.lib.llama_tokenize(self.vocab, data, len(data), buf, len(buf), False, True)
        if n < 0:
            raise KvprobeError(f"llama.cpp's tokenizer needs {-n} tokens for a {len(data)}-byte text")
        return list(buf[:n])

    def piece(self, token: int) -> str:
        buf = ctypes.create_string_buffer(256)
        n = self.lib.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        return buf.raw[:max(n, 0)].decode(errors="replace")

    def is_end(self, token: int) -> bool:
        return bool(self.lib.llama_vocab_is_eog(self.vocab, token))

    def _live(self) -> None:
        if not self.ctx:
            raise EnvironmentProblem(f"the llama.cpp engine for {self.path.name} is closed (its sessions went with "
                                     f"it); start a new Engine")

    def _session(self, s: int) -> list[int]:
        self._live()
        if s not in self._held:
            raise UsageError(f"no session {s} in the engine; open sessions: {sorted(self._held) or 'none'}")
        return self._held[s]

    def _decode(self, seq: int, ids: Sequence[int], start: int, logits: bool) -> np.ndarray | None:
        """Decode ``ids`` at positions start.. in ``seq`` (in batches of n_batch); the last token's
        logits (V,) if asked."""
        if start + len(ids) > self.n_ctx:
            raise KvprobeError(f"{start + len(ids)} tokens do not fit the engine's context of {self.n_ctx}; "
                               f"start the engine with a larger n_ctx")
        b, out = self.batch, None
        for at in range(0, len(ids), self.n_batch):
            chunk = ids[at: at + self.n_batch]
            for i, tok in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i] = int(tok), start + at + i, 1
                b.seq_id[i][0], b.logits[i] = seq, 0
            last = at + len(chunk) == len(ids)
            b.logits[len(chunk) - 1] = int(logits and last)
            b.n_tokens = len(chunk)
            rc = self.lib.llama_decode(self.ctx, b)
            if rc != 0:
                raise KvprobeError(f"llama.cpp refused a batch of {len(chunk)} tokens at position {start + at} "
                                   f"(llama_decode returned {rc}): {_last_error()}")
        if logits:
            ptr = self.lib.llama_get_logits_ith(self.ctx, -1)
            out = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()
        return out

    def _drop(self, seq: int, start: int = -1) -> None:
        self.lib.llama_memory_seq_rm(self.mem, seq, start, -1)

    # -- what a server does ----------------------------------------------------------------------
    def open(self, s: int) -> None:
        """Start session ``s`` empty (an open one is emptied)."""
        self._live()
        if not 0 <= s < self.sessions:
            raise UsageError(f"session {s} out of range; this engine holds sessions 0..{self.sessions - 1}")
        self._drop(s)
        self._held[s] = []

    def ids(self, s: int) -> list[int]:
        return list(self._session(s))

    def serve(self, s: int, ids: Sequence[int]) -> tuple[np.ndarray, int]:
        """A request of session ``s`` for the prompt ``ids``: the longest prefix it shares with what
        the session holds is reused, the rest decoded (the last token at least, for its logits).
        Returns (the last token's logits (V,), tokens computed); the session then holds ``ids``."""
        held = self._session(s)
        if not ids:
            raise UsageError("an empty prompt has no token to read a decision at")
        keep = next((i for i, (x, y) in enumerate(zip(held, ids)) if x != y), min(len(held), len(ids)))
        keep = min(keep, len(ids) - 1)
        self._drop(s, keep)
        del held[keep:]
        try:
            logits = self._decode(s, ids[keep:], keep, logits=True)
        except BaseException:  # a refused batch or an interrupt: the session holds the shared prefix only
            self._drop(s, keep)
            raise
        held.extend(ids[keep:])
        return logits, len(ids) - keep

    def read(self, s: int, tail: Sequence[int]) -> np.ndarray:
        """Feed ``tail`` after what session ``s`` holds and return the last token's logits (V,);
        the session is left as it was (kvprobe's decision read: ``kv.decode.decide``)."""
        n = len(self._session(s))
        try:
            return self._decode(s, tail, n, logits=True)
        finally:
            self._drop(s, n)

    def ask(self, s: int, ids: Sequence[int], max_tokens: int) -> tuple[list[int], int]:
        """Greedy tokens (up to ``max_tokens``; an end-of-generation token ends them) for the prompt
        ``ids``, a side request of session ``s``: the prefix it shares with what the session holds is
        reused, the rest decoded in the scratch sequence, and the session is left as it was.
        Returns (the tokens, the prompt tokens computed)."""
        held = self._session(s)
        if not ids:
            raise UsageError("an empty prompt has nothing to answer")
        keep = next((i for i, (x, y) in enumerate(zip(held, ids)) if x != y), min(len(held), len(ids)))
        keep = min(keep, len(ids) - 1)
        scratch, out = self.scratch, []
        self._drop(scratch)
        try:
            self.lib.llama_memory_seq_cp(self.mem, s, scratch, 0, keep)
            at, feed = keep, list(ids[keep:])
            for _ in range(max_tokens):
                tok = int(np.argmax(self._decode(scratch, feed, at, logits=True)))
                at += len(feed)
                if self.is_end(tok):
                    break
                out.append(tok)
                feed = [tok]
            return out, len(ids) - keep
        finally:
            self._drop(scratch)

    def edit(self, s: int, start: int, new_ids: Sequence[int], also: Sequence[int] = ()) -> int:
        """Write ``new_ids`` over the positions [start, start + len(new_ids)) of session ``s`` and
        recompute them, then recompute the positions ``also`` (after the field) against the cache as
        it then is; every other cell is kept as it was. Returns the tokens recomputed.

        A value of another token length cannot be written in place (:class:`InPlaceRefused`)."""
        held = self._session(s)
        end = start + len(new_ids)
        if not new_ids or start < 0 or end > len(held):
            raise InPlaceRefused(f"the edit covers positions [{start}, {end}) but session {s} holds "
                                 f"{len(held)} tokens: a value of another token length, or past the cached "
                                 f"prompt, cannot be edited in place; re-render the prompt")
        later = sorted(set(int(p) for p in also))
        if later and (later[0] < end or later[-1] >= len(held)):
            raise UsageError(f"positions to recompute must lie after the field (>= {end}) and inside the "
                             f"{len(held)} cached tokens; got {later[0]}..{later[-1]}")
        ids = list(held)
        ids[start:end] = [int(t) for t in new_ids]
        runs = _runs(list(range(start, end)) + later)
        scratch, shared = self.scratch, 0
        self._drop(scratch)
        try:  # the session is untouched until the scratch sequence holds the whole repaired prompt
            for p0, p1 in runs:
                self.lib.llama_memory_seq_cp(self.mem, s, scratch, shared, p0)  # the kept cells in [shared, p0)
                self._decode(scratch, ids[p0:p1], p0, logits=False)
                shared = p1
            self.lib.llama_memory_seq_cp(self.mem, s, scratch, shared, -1)
            self._drop(s)
            self.lib.llama_memory_seq_cp(self.mem, scratch, s, -1, -1)
        finally:
            self._drop(scratch)
        held[:] = ids
        return sum(p1 - p0 for p0, p1 in runs)


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    """Sorted positions as half-open runs of consecutive ones: [3, 4, 5, 9] -> [(3, 6), (9, 10)]."""
    runs: list[tuple[int, int]] = []
    for p in sorted(set(positions)):
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs


def check_ids(engine_ids: Sequence[int], kvprobe_ids: Sequence[int], what: str) -> None:
    """The engine's tokens of a prompt must be kvprobe's (the alignment's spans index both)."""
    if list(engine_ids) != list(kvprobe_ids):
        at = next((i for i, (x, y) in enumerate(zip(engine_ids, kvprobe_ids)) if x != y),
                  min(len(engine_ids), len(kvprobe_ids)))
        raise KvprobeError(f"llama.cpp's tokenizer and kvprobe's disagree on {what} from token {at} "
                           f"({len(engine_ids)} against {len(kvprobe_ids)} tokens): the field spans would not "
                           f"match; use a model whose GGUF tokenizer is the one kvprobe loads")


def float32_gguf(src: Path, dst: Path) -> Path:
    """``src`` with every tensor dequantised to float32 by gguf-py (llama.cpp's own GGUF library),
    the metadata copied: the weights kvprobe's bundled model folder holds, for an exact comparison.
    Written beside ``dst`` and renamed into place; an existing ``dst`` is kept."""
    import gguf

    if dst.exists():
        return dst
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tmp = dst.with_name(dst.name + ".part")
    writer = gguf.GGUFWriter(tmp, arch)
    for f in reader.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        if f.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(gguf.LlamaFileType.ALL_F32)
            continue
        kind = f.types[0]
        sub = f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, data.reshape([int(x) for x in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)
    return dst


def float32_of(alias: str, progress=lambda s: None) -> Path:
    """A bundled model's GGUF in float32 (:func:`float32_gguf`), made once under
    ``$KVPROBE_HOME/engine``: the engine side of an exact comparison with kvprobe's model."""
    from kvprobe.models import bundled
    from kvprobe.paths import home, make_dir

    dst = make_dir(home() / ENGINE_DIR) / f"{alias}.f32.gguf"
    return bundled.gguf_file(alias, progress, lambda src: float32_gguf(src, dst))
