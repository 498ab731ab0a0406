"""Two processes (here: two threads, each with its own open file, which flock treats alike) fetching
one bundled model: the second waits for the first and then finds the folder ready, so the GGUF is
assembled and dequantised once and no half-written file is read."""

from __future__ import annotations

import threading
import time

from kvprobe.models import bundled


def test_a_second_fetch_waits_for_the_first_and_does_no_work(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPROBE_HOME", str(tmp_path))
    busy, calls, overlap = threading.Lock(), [], []

    def assemble(b, progress):
        if not busy.acquire(blocking=False):
            overlap.append(b.alias)  # another fetch is inside the locked section
            busy.acquire()
        calls.append(b.alias)
        time.sleep(0.5)
        busy.release()
        return tmp_path / "fake.gguf"

    def dequantize(gguf, folder, model_class, progress):
        folder.mkdir(parents=True)
        (folder / bundled.READY_MARKER).write_text("{}")

    monkeypatch.setattr(bundled, "assemble_gguf", assemble)
    monkeypatch.setattr(bundled, "dequantize_to_folder", dequantize)
    folders = []
    threads = [threading.Thread(target=lambda: folders.append(bundled.fetch("smollm2-135m"))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert calls == ["smollm2-135m"] and not overlap
    assert folders == [bundled.BUNDLED["smollm2-135m"].folder] * 2 and bundled.is_cached("smollm2-135m")
    assert str(folders[0]).startswith(str(tmp_path))


def test_a_dequantisation_says_its_progress_in_plain_lines():
    """transformers counts a GGUF's tensors with a tqdm bar (carriage returns in a log): a fetch replaces it, for
    the dequantisation only, by kvprobe's own progress lines (the count at most every 10 s and at the end)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from kvprobe.models.quiet import plain_tensor_progress

    lines, bar = [], gguf_utils.tqdm
    with plain_tensor_progress(lines.append):
        assert list(gguf_utils.tqdm(list(range(7)), desc="Converting and de-quantizing GGUF tensors...")) == \
            list(range(7))
    assert lines == ["dequantising: 7/7 tensors"] and gguf_utils.tqdm is bar
