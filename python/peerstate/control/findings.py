"""Findings: what a worker detects that makes its run no longer bitwise equal to
a fault-free one (a replacement's RNG states changed between its restore and its
first step: a seed set or a random draw after ``track()``, a batch prefetched
across steps), a collective the script ran between two guarded steps, where no
recovery reaches it (``UNGUARDED``), random numbers it drew there, which no
recovery replays (``UNGUARDED_DRAW``), or a call of the script that peerstate
overrode to keep its bounds (``OVERRIDDEN``: a process-group timeout past
them). A worker reports
each to its agent through the node channel; the agent says it on ``peerstate
run``'s console at once, lists every one in its closing summary, and under
``--strict`` stops the job. Said in the worker's log alone, a finding went
unread: the run ended with exit code 0 and different parameters."""

from __future__ import annotations

import json
import sys
from typing import Callable, List, Optional

from peerstate.control import keys
from peerstate.control.kvstore import KeyValueStore
from peerstate.control.timeline import EventLog


NOT_BITWISE = "not_bitwise"
OVERRIDDEN = "overridden"
UNGUARDED = "unguarded"
UNGUARDED_DRAW = "unguarded_draw"
# kind -> (what a finding of it says before its cause, what the closing summary says of the run), by weight
_WORDS = {NOT_BITWISE: ("this run is no longer bitwise equal to a fault-free one: ",
                        "the run is not bitwise equal to a fault-free one"),
          UNGUARDED: ("a collective ran outside job.guard(), where no recovery reaches it: ",
                      "the script ran collectives outside job.guard()"),
          UNGUARDED_DRAW: ("a random draw ran outside job.guard(), which a recovery does not replay: ",
                           "the script drew random numbers outside job.guard()"),
          OVERRIDDEN: ("peerstate overrode a call of the script: ", "peerstate overrode calls of the script")}


def report_finding(channel: KeyValueStore, rank: int, worker: str, step: int, cause: str,
                   kind: str = NOT_BITWISE) -> None:
    """Hand one finding to this worker's agent (``channel``: its node channel)."""
    index = channel.add(keys.FINDINGS, 1)
    channel.set(keys.finding(index), json.dumps({"rank": rank, "worker": worker, "step": step,
                                                 "cause": cause, "kind": kind}).encode())


def describe(finding: dict) -> str:
    what = _WORDS[finding.get("kind", NOT_BITWISE)][0]
    return f"rank {finding['rank']} ({finding['worker']}) at step {finding['step']}: {what}{finding['cause']}"


class FindingsReader:
    """The agent's side: each finding once, in the order they were reported."""

    def __init__(self, channel: KeyValueStore) -> None:
        self._channel = channel
        self._read = 0
        self.found: List[dict] = []

    def new(self) -> List[dict]:
        """The findings reported since the last call (one whose counter is bumped but whose
        entry is not written yet is read at the next call)."""
        fresh = []
        count = self._channel.add(keys.FINDINGS, 0)
        while self._read < count:
            raw = self._channel.get(keys.finding(self._read + 1))
            if raw is None:
                break
            self._read += 1
            fresh.append(json.loads(raw))
        self.found.extend(fresh)
        return fresh

    def say_new(self, events: EventLog, stop: Optional[Callable[[str], None]] = None) -> None:
        """Say each new finding on the console and in the event log; ``stop`` (under
        --strict) is handed the first one's description and stops the job."""
        for finding in self.new():
            events.write(finding.get("kind", NOT_BITWISE), **finding)
            print(f"peerstate: {describe(finding)}", file=sys.stderr, flush=True)
            if stop is not None:
                stop(f"--strict: {describe(finding)}")

    def say_all(self, ending: str) -> None:
        """The closing summary: every finding again, where a user reads last."""
        if self.found:
            lines = "\n".join(f"  {describe(f)}" for f in self.found)
            kinds = {f.get("kind", NOT_BITWISE) for f in self.found}
            but = next(summary for kind, (_, summary) in _WORDS.items() if kind in kinds)
            print(f"peerstate: {ending}, but {but} ({len(self.found)} finding(s); --strict stops the job at the "
                  f"first):\n{lines}", file=sys.stderr, flush=True)
