"""The ``peerstate`` command: ``peerstate run`` (the launcher)."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import List, Optional


def _run(args: argparse.Namespace) -> int:
    import os

    from peerstate.launcher.command_line import agent_config, agent_environment

    os.environ.update(agent_environment(os.environ))  # before the agent imports torch
    from peerstate.launcher.agent import Agent
    from peerstate.errors import Error

    try:
        agent = Agent(agent_config(args, os.environ))
    except Error as error:
        print(f"peerstate run: {error}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds run(): every child is killed
    return agent.run()


def _goodput(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from peerstate.tools import goodput

    fields = goodput.GoodputInputs.__dataclass_fields__
    overrides = {name: getattr(args, name) for name in fields}
    results = Path(args.results)
    inputs = goodput.inputs_from_results(results, **overrides)
    if not (results / "recovery.json").exists():
        print(f"note: {results}/recovery.json not found: peerstate's recovery time is the default "
              f"{inputs.peerstate_recovery_s}s (run bench/recovery.py, or pass --peerstate-recovery-s)")
    rows = goodput.table(inputs, args.sizes, args.monte_carlo, args.seed)
    goodput.print_table(inputs, rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"inputs": goodput.as_dict(inputs), "rows": rows}, indent=1))
    if args.png:
        if goodput.plot(inputs, Path(args.png)):
            print(f"wrote {args.png}")
        else:
            print("no plot: matplotlib is not installed (pip install 'peerstate[demo]')")
    return 0


def parser() -> argparse.ArgumentParser:
    from peerstate.launcher.command_line import add_run_arguments

    top = argparse.ArgumentParser(prog="peerstate", description="Checkpointless training for PyTorch.")
    commands = top.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run", help="launch a training script with hot spares (torchrun-compatible environment)",
        description="Start this node's agent: it runs --nproc-per-node workers and --spares hot spares of the "
                    "script, replaces a failed worker with a spare and recovers the job in place.")
    add_run_arguments(run)
    run.set_defaults(handler=_run)

    from peerstate.tools.goodput import DEFAULT_SIZES, GoodputInputs

    model = commands.add_parser(
        "goodput", help="expected goodput vs cluster size: checkpoint-restart, in-memory restart, peerstate",
        description="The goodput model (formulas and sources: peerstate/goodput.py and docs/recovery.md). "
                    "peerstate's overhead and recovery time are read from the benchmark results.")
    model.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="accelerator counts")
    model.add_argument("--results", default="bench/results", help="where overhead.json and recovery.json are")
    model.add_argument("--monte-carlo", type=float, default=0.0, metavar="DAYS",
                       help="also simulate DAYS of training per size and count buddy losses")
    model.add_argument("--seed", type=int, default=0)
    model.add_argument("--png", default=None, help="draw goodput vs cluster size here")
    model.add_argument("--json", default=None, help="write the table here")
    for name, spec in GoodputInputs.__dataclass_fields__.items():
        kind = int if spec.type in ("int", int) else float
        model.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=None,
                           help=f"default {spec.default}")
    model.set_defaults(handler=_goodput)

    demo = commands.add_parser("demo", add_help=False,
                               help="train a small GPT, kill ranks and a node, recover, report (CPU, minutes)")
    demo.set_defaults(handler=None)
    return top


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:  # the demo parses its own flags
        from peerstate.demo import main as demo

        return demo(argv[1:])
    args = parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
