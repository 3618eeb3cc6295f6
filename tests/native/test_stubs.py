"""Each native module's stub (``_C.pyi``, ``_probes.pyi``) declares exactly the
names the module has: a binding moved between the two, or added without its
contract, fails here. (A probe's error is ``_C``'s class: test_crc32c.)"""

import ast
from pathlib import Path

import pytest

import peerstate
from peerstate import _C, _probes


def declared(stub: Path) -> set:
    names = set()
    for node in ast.parse(stub.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            names.add(node.target.id)
    return names


@pytest.mark.parametrize("module", [_C, _probes], ids=lambda m: m.__name__)
def test_the_stub_declares_every_public_name_and_no_other(module):
    stub = Path(peerstate.__file__).with_name(module.__name__.rpartition(".")[2] + ".pyi")
    assert declared(stub) == {name for name in dir(module) if not name.startswith("_")}

