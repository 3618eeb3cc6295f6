"""The status-code table (csrc/common/status.h) against what Python sees: the
native exceptions, ``_C.pyi`` and ``peerstate.errors``."""

import ast
import builtins
from pathlib import Path

import peerstate
from peerstate import _C, errors

PYI = Path(peerstate.__file__).with_name("_C.pyi")


def pyi_exceptions():
    tree = ast.parse(PYI.read_text())
    return {node.name: [base.id for base in node.bases] for node in tree.body
            if isinstance(node, ast.ClassDef) and node.bases and getattr(node.bases[0], "id", "") in ("Error", "Exception")}


def test_every_code_has_its_exception_with_the_bases_the_table_names():
    assert [value for value, *_ in _C.status_codes] == list(range(1, len(_C.status_codes) + 1))
    for _, code, name, builtin, doc in _C.status_codes:
        exception = getattr(_C, name)
        assert exception.__bases__ == ((_C.Error, getattr(builtins, builtin)) if builtin else (_C.Error,)), code
        assert exception.__doc__ == doc


def test_the_stub_declares_the_table_and_nothing_else():
    declared = pyi_exceptions()
    table = {name: ["Error", builtin] if builtin else ["Error"] for _, _, name, builtin, _ in _C.status_codes}
    assert declared == {"Error": ["Exception"], **table}


def test_errors_exports_every_native_exception():
    names = {name for _, _, name, _, _ in _C.status_codes} | {"Error"}
    assert names <= set(errors.__all__)
    assert all(getattr(errors, name) is getattr(_C, name) for name in names)
    assert set(errors.__all__) - names == {"JobFailedError", "StateLostError", "StoreUnavailableError"}
