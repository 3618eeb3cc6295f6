"""The package's planes import one way (docs/layout.md), read from the source with
``ast``: every import counts, at module level, inside functions and under
``TYPE_CHECKING``, absolute or relative, ``import peerstate.x`` or ``from peerstate
import x``. A plane imports only planes below it; ``worker/`` and ``launcher/``
never each other; the root package (``import peerstate``, the public API) only from
the top; and no two modules import each other, directly or around a loop. The
native core's directories include one way too (``#include "dir/..."``)."""

import ast
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "peerstate"
CSRC = Path(__file__).resolve().parents[1] / "csrc"
# The native core's directories by rank: device/ (CUDA and NCCL) implements interfaces of
# common/ (DeviceCopyEngine) and net/ (its NCCL Transport); replication/ and device/ never
# include each other; bindings/ sees everything.
NATIVE_RANKS = {"common": 0, "store": 1, "net": 2, "replication": 3, "device": 3, "bindings": 4}

# Leaves any module may import: the native module, the errors it raises, the key schema.
LEAVES = {"peerstate._C", "peerstate.errors", "peerstate.control.keys"}
PROBES = "peerstate._probes"  # the tests' and benchmarks' native hooks: no module of the package's
# Each plane's rank: a module imports only ranks below its own, or its own plane.
RANKS = {"state": 1, "replication": 2, "control": 3, "worker": 4, "launcher": 4, "tools": 5,
         "integrations": 6, "demo": 6, "cli": 7, "__main__": 8}
ROOT = "peerstate"  # the package itself: the public API, for the top planes and users


def module_names(package: Path) -> Dict[str, Path]:
    names = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    for native in ("_C", "_probes"):  # the native modules, as their stubs declare them
        names[f"{package.name}.{native}"] = package / f"{native}.pyi"
    return names


def imports_of(name: str, path: Path, modules: Dict[str, Path]) -> Set[str]:
    """The package's modules ``name`` imports (the root for ``import peerstate`` or a
    name of the root that is not a module)."""
    top = name.split(".")[0]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == top}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            if base.split(".")[0] != top:
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else base)
    return {module for module in found if module != name}


def plane(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def violations(package: Path) -> List[str]:
    modules = module_names(package)
    graph = {name: (imports_of(name, path, modules) if path.suffix == ".py" else set())
             for name, path in modules.items()}
    wrong = []
    for name, imported in sorted(graph.items()):
        for target in sorted(imported):
            if target == PROBES:
                wrong.append(f"{name} imports {PROBES}: the measurement hooks are the tests' and benchmarks'")
                continue
            if target in LEAVES or plane(target) == plane(name) != ROOT:
                continue
            if target == ROOT:
                if RANKS.get(plane(name), 0) < RANKS["integrations"]:
                    wrong.append(f"{name} imports the root package {ROOT} (the public API is for the top planes)")
                continue
            if plane(name) == ROOT:
                wrong.append(f"{ROOT} imports {target}: the root imports only leaves (the rest lazily)")
                continue
            mine, theirs = RANKS.get(plane(name)), RANKS.get(plane(target))
            if mine is None or theirs is None or theirs >= mine:
                wrong.append(f"{name} ({plane(name)}) imports {target} ({plane(target)})")
    wrong += [f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(graph)]
    return wrong


def cycles(graph: Dict[str, Set[str]]) -> List[Tuple[str, ...]]:
    """One loop through each strongly connected group of modules (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(tuple(sorted(group)) + (sorted(group)[0],))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_planes_import_one_way_and_no_module_imports_itself_around_a_loop():
    assert violations(PACKAGE) == []


def test_a_planted_back_import_a_root_import_and_a_loop_are_each_found(tmp_path):
    package = tmp_path / "peerstate"
    for module, source in {
        "__init__.py": "",
        "_C.pyi": "",
        "_probes.pyi": "",
        "errors.py": "from peerstate import _C\n",
        "state/__init__.py": "",
        "state/buffers.py": "def f():\n    from peerstate.worker import job\n",  # a back-import, in a function
        "state/snapshot.py": "from peerstate import _probes\n",  # a test hook in the product
        "control/__init__.py": "",
        "control/keys.py": "",
        "control/kvstore.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .memory_store import M\n",
        "control/memory_store.py": "from peerstate.control import kvstore\n",  # kvstore <-> memory_store
        "worker/__init__.py": "",
        "worker/job.py": "from peerstate.control import keys\nfrom peerstate.launcher.agent import Agent\n",
        "launcher/__init__.py": "",
        "launcher/agent.py": "import peerstate\n",
    }.items():
        (package / module).parent.mkdir(parents=True, exist_ok=True)
        (package / module).write_text(source)
    assert violations(package) == [
        "peerstate.launcher.agent imports the root package peerstate (the public API is for the top planes)",
        "peerstate.state.buffers (state) imports peerstate.worker.job (worker)",
        "peerstate.state.snapshot imports peerstate._probes: the measurement hooks are the tests' and benchmarks'",
        "peerstate.worker.job (worker) imports peerstate.launcher.agent (launcher)",
        "import cycle: peerstate.control.kvstore -> peerstate.control.memory_store -> peerstate.control.kvstore",
    ]


def include_violations(csrc: Path) -> List[str]:
    wrong = []
    for path in sorted(csrc.rglob("*")):
        if path.suffix not in (".h", ".cc", ".cu", ".cuh"):
            continue
        mine = path.relative_to(csrc).parts[0]
        for line, target in re.findall(r'^(\s*#\s*include\s+"([a-z_]+)/[^"]+")', path.read_text(), re.M):
            if target == mine:
                continue
            if NATIVE_RANKS.get(target, 99) >= NATIVE_RANKS.get(mine, -1):
                wrong.append(f"{path.relative_to(csrc)} ({mine}) includes {target}/: {line.strip()}")
    return wrong


def test_the_native_directories_include_one_way():
    assert include_violations(CSRC) == []


def test_a_planted_wrong_include_is_found(tmp_path):
    for name, text in {"store/snapshot_store.h": '#include "common/status.h"\n#include "device/cuda_copy.h"\n',
                       "device/nccl_transport.h": '#include "net/transport.h"\n',
                       "replication/replicator.cc": '#include "device/nccl_transport.h"\n'}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert include_violations(tmp_path) == [
        'replication/replicator.cc (replication) includes device/: #include "device/nccl_transport.h"',
        'store/snapshot_store.h (store) includes device/: #include "device/cuda_copy.h"',
    ]
