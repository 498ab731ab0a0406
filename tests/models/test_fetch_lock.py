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

    def dequantize(gguf, folder, model_class):
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
