"""What ``Job.new_group``, ``Job.device_mesh`` and ``Job.build_meshes`` refuse, before
any group exists: ranks and shapes that do not fit the world, each said with what was
given."""

import pytest

pytest.importorskip("torch")

from peerstate.errors import InvalidArgumentError  # noqa: E402
from peerstate.worker.meshes import BuiltMeshes, DeclaredMesh  # noqa: E402
from peerstate.worker.process_groups import Subgroup  # noqa: E402


@pytest.mark.parametrize("ranks", [[], [0, 0], [0, 4], [-1, 1]])
def test_a_subgroup_needs_distinct_ranks_of_the_world(ranks):
    with pytest.raises(InvalidArgumentError, match=r"new_group\(\) needs distinct ranks in \[0, 4\), got"):
        Subgroup.declared(ranks, {}, world_size=4)


def test_a_subgroup_of_the_world_keeps_its_ranks_and_options():
    subgroup = Subgroup.declared((3, 1), {"backend": "gloo"}, world_size=4)
    assert subgroup.ranks == [3, 1] and subgroup.options == {"backend": "gloo"}


@pytest.mark.parametrize("shape, names, says", [
    ([2, 3], None, "sizes multiply to the world size 4, got [2, 3]"),
    ([4, 0], None, "got [4, 0]"),
    ([], None, "got []"),
    ([2, 2], ["dp"], "got 1 dimension names ['dp'] for the 2 dimensions of [2, 2]"),
])
def test_a_declared_mesh_must_cover_the_world(shape, names, says):
    with pytest.raises(InvalidArgumentError) as raised:
        DeclaredMesh.declared("cpu", shape, names, world_size=4)
    assert says in str(raised.value)


def test_a_declared_mesh_of_the_world_keeps_its_shape_and_names():
    mesh = DeclaredMesh.declared("cpu", ["2", 2], ("dp", "tp"), world_size=4)
    assert mesh.shape == (2, 2) and mesh.dim_names == ("dp", "tp")


def test_a_builders_layout_must_cover_the_world():
    with pytest.raises(InvalidArgumentError, match=r"layout=\[\('dp', 2\), \('tp', 3\)\]\): the sizes must multiply"):
        BuiltMeshes.declared(lambda: None, [("dp", 2), ("tp", 3)], world_size=4)
    built = BuiltMeshes.declared(lambda: None, [("dp", 2), ("tp", 2)], world_size=4)
    assert built.shape == (2, 2) and built.dim_names == ("dp", "tp")
    assert BuiltMeshes.declared(lambda: None, None, world_size=4).shape == ()
