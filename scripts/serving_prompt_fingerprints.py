"""Fingerprints of the serving benchmarks' prompts: the single-field policy (``build_policy``) and the
agent workload's padded template (``padded_spec``), over tokenizers, lengths and seeds. Write them
before and after a change that must keep the prompts, and compare:

    python scripts/serving_prompt_fingerprints.py before.json
    python scripts/serving_prompt_fingerprints.py after.json --compare before.json    # exit 1 if any differs
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "serving"))


def fingerprints() -> dict[str, str]:
    from conftest import CHAT_TEMPLATE, make_byte_tokenizer

    from kvprobe.calibrate.engine import load_spec
    from kvprobe.serving.workload import padded_spec
    from kvprobe.serving.bench import load_tokenizer
    from kvprobe.serving.prompts import build_policy

    toks = {"bytes": make_byte_tokenizer(), "bytes-chat": make_byte_tokenizer(CHAT_TEMPLATE),
            "smollm2": load_tokenizer("smollm2-135m"), "qwen": load_tokenizer("qwen2.5-1.5b")}
    out = {}
    for name, tok in toks.items():
        for target in (1000, 1500, 3000, 8000):
            for seed in (0, 1):
                if name != "bytes-chat":  # the single-field policy: any tokenizer
                    p = build_policy(tok, target, seed)
                    out[f"policy/{name}/{target}/{seed}"] = hashlib.sha256(
                        repr((p.ids(tok), p.case.fillers)).encode()).hexdigest()[:16]
                if name != "bytes":  # the agent template: chat messages, so a chat template
                    for spec in ("agent-refund.yaml", "calibrate-refund-clear.yaml"):
                        s = padded_spec(load_spec(ROOT / "examples" / spec), tok, target, seed)
                        out[f"spec/{name}/{spec}/{target}/{seed}"] = s.digest()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--compare", help="an earlier output to compare with")
    args = ap.parse_args()
    got = fingerprints()
    Path(args.out).write_text(json.dumps(got, indent=0, sort_keys=True))
    print(f"{len(got)} prompts fingerprinted into {args.out}")
    if args.compare:
        before = json.loads(Path(args.compare).read_text())
        differ = sorted(k for k in set(before) | set(got) if before.get(k) != got.get(k))
        print("same prompts" if not differ else f"{len(differ)} differ: {', '.join(differ)}")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
