"""Goodput model: expected goodput vs cluster size (1k to 100k accelerators) for
checkpoint-restart at the Young/Daly interval, a ~2 min in-memory restart
(HyperPod's published figure) and peerstate with its measured overhead and
recovery time (bench/results/overhead.json and recovery.json), with a
Monte-Carlo check of the closed forms. Formulas and sources: python/peerstate/tools/goodput.py.

Run: python bench/goodput.py  (writes bench/results/goodput.json and goodput.png)
"""

import json
import sys
from pathlib import Path

from peerstate.tools import goodput

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    inputs = goodput.inputs_from_results(RESULTS)
    rows = goodput.table(inputs, goodput.DEFAULT_SIZES, monte_carlo_days=60, seed=1)
    goodput.print_table(inputs, rows)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "goodput.json").write_text(json.dumps({"inputs": goodput.as_dict(inputs), "rows": rows}, indent=1))
    if not goodput.plot(inputs, RESULTS / "goodput.png"):
        print("no plot: matplotlib is not installed (pip install 'peerstate[demo]')", file=sys.stderr)
    print(f"wrote {RESULTS / 'goodput.json'}")


if __name__ == "__main__":
    main()
