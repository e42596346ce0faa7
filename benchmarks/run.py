"""`make bench`: run every benchmark in its own process and print the ratios side by side.

Each `bench_*.py` measures tomlens against its baseline in the same run and writes
`bench-out/<name>.json`; this runner only sequences them and prints the collected ratios.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "bench-out"
BENCHES = ("cache", "probes", "patching", "search", "behaviour")


def main() -> int:
    OUT.mkdir(exist_ok=True)
    failed = []
    for name in BENCHES:
        script = HERE / f"bench_{name}.py"
        print(f"\n=== {name} ({script.name}) ===", flush=True)
        t0 = time.time()
        rc = subprocess.call([sys.executable, str(script)], cwd=HERE.parent)
        print(f"--- {name}: exit {rc}, {time.time() - t0:.0f} s", flush=True)
        if rc:
            failed.append(name)
    print("\n=== summary (ratios measured side by side in this run) ===")
    for name in BENCHES:
        path = OUT / f"{name}.json"
        if path.exists():
            data = json.loads(path.read_text())
            for key, value in data.get("ratios", {}).items():
                print(f"{name:<10}{key:<72} {value}")
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
