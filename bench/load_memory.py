"""A runner's memory as it loads a real shape: the peak resident size while loading, and the anonymous and
file-backed resident size once loaded (the checkpoint's pages count as file-backed while the file is mapped). Each
format's runner in a process of its own, read from /proc/self/status; the shape is built first where it is not
cached (`overlap model build-shape`). docs/engine.md ("Pages faulted in every step") has a run.

    .venv/bin/python -m bench.load_memory qwen2.5-1.5b none,w8a8,w4a16    # from the repository root
"""

from __future__ import annotations

import json
import subprocess
import sys

SCHEMES = ("none", "w8a8", "w4a16")

ONE = """
import json, sys
from overlap.engine.config import EngineConfig
from overlap.engine.model.runner import ModelRunner
from overlap.engine.model.shapes import ensure_shape_model
scheme = None if sys.argv[2] == "none" else sys.argv[2]
folder = ensure_shape_model(sys.argv[1], lambda m: print(m, file=sys.stderr), scheme)
def status():
    return {l.split(":")[0]: int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(("Vm", "Rss"))}
runner = ModelRunner(EngineConfig(model=str(folder), dtype="bfloat16", num_threads=2, max_seq_len=160,
                                  max_num_seqs=1, num_kv_blocks=16), folder)
after = status()
print(json.dumps({"weights_mb": runner.weight_bytes / 1e6, "peak_kb": after["VmHWM"],
                  "anon_kb": after["RssAnon"], "file_kb": after["RssFile"]}))
"""


def main(shape: str, schemes: list[str]) -> None:
    print(f"{shape}, bf16 activations, each runner loaded in a process of its own")
    print("format | weights MB | peak while loading GB | resident once loaded GB: anonymous + file-backed")
    for scheme in schemes:
        out = subprocess.run([sys.executable, "-c", ONE, shape, scheme], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.splitlines()[-1])
        peak, anon, file = (r[key] / 1e6 for key in ("peak_kb", "anon_kb", "file_kb"))
        print(f"{scheme:>6} | {r['weights_mb']:10.0f} | {peak:21.2f} | {anon:.2f} + {file:.2f}")


if __name__ == "__main__":
    if len(sys.argv) != 3 or any(s not in SCHEMES for s in sys.argv[2].split(",")):
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help") else 2)
    main(sys.argv[1], sys.argv[2].split(","))
