"""Goodput model: expected goodput vs cluster size (1k to 100k accelerators) for
checkpoint-restart at the Young/Daly interval, a ~2 min in-memory restart
(HyperPod's published figure) and peerstate with its measured overhead and
recovery time (bench/results/overhead.json and recovery.json), with a
Monte-Carlo check of the closed forms; then peerstate's redundancy modes (buddies,
parity groups; 4 or 2 versions) for one job's shape: host memory, traffic, the
step's overhead and goodput per mode (redundancy.json, recovery_parity4.json,
recovery_replicated_one_per_node.json). Formulas and sources:
python/peerstate/tools/goodput.py and goodput_modes.py.

Run: python bench/goodput.py  (writes bench/results/goodput.json and goodput.png)
"""

import json
import sys
from pathlib import Path

from peerstate.tools import goodput, goodput_modes

RESULTS = Path(__file__).resolve().parent / "results"
MODE_SIZES = (1024, 16384)


def main() -> None:
    inputs = goodput.inputs_from_results(RESULTS)
    rows = goodput.table(inputs, goodput.DEFAULT_SIZES, monte_carlo_days=60, seed=1)
    goodput.print_table(inputs, rows)
    modes = goodput_modes.modes_from_results(RESULTS)
    mode_rows = []
    for shape in goodput_modes.SHAPES:
        shape_rows = goodput_modes.table(inputs, shape, modes, MODE_SIZES)
        mode_rows += shape_rows
        if modes:
            print()
            goodput_modes.print_table(shape, shape_rows)
    if not modes:
        print("no per-mode table: run bench/redundancy.py and bench/recovery.py --parity-group 4, --replicated "
              "--one-per-node first", file=sys.stderr)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "goodput.json").write_text(json.dumps({"inputs": goodput.as_dict(inputs), "rows": rows,
                                                      "modes": goodput_modes.as_dict(goodput_modes.SHAPES, modes),
                                                      "mode_rows": mode_rows}, indent=1))
    if not goodput.plot(inputs, RESULTS / "goodput.png"):
        print("no plot: matplotlib is not installed (pip install 'peerstate[demo]')", file=sys.stderr)
    print(f"wrote {RESULTS / 'goodput.json'}")


if __name__ == "__main__":
    main()
