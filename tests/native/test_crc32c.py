import numpy as np
import pytest

from peerstate import _probes


@pytest.mark.parametrize("impl", ["software", "hardware", "auto"])
def test_known_vectors(impl):
    # RFC 3720 (iSCSI) appendix B.4 and the classic check value.
    assert _probes.crc32c(b"123456789", implementation=impl) == 0xE3069283
    assert _probes.crc32c(bytes(32), implementation=impl) == 0x8A9136AA
    assert _probes.crc32c(b"\xff" * 32, implementation=impl) == 0x62A8AB43
    assert _probes.crc32c(bytes(range(32)), implementation=impl) == 0x46DD794E
    assert _probes.crc32c(b"", implementation=impl) == 0


def test_hardware_equals_software_at_every_lane_boundary(rng):
    # Hardware lanes: blocks of 4 x 4096 bytes, then blocks of 3 x 256, then 8-byte words.
    data = rng.integers(0, 256, size=4 * 4096 * 2 + 3 * 256 * 3 + 77, dtype=np.uint8).tobytes()
    for n in [0, 1, 7, 8, 9, 255, 767, 768, 769, 4 * 4096 - 1, 4 * 4096, 4 * 4096 + 1, 4 * 4096 + 768, len(data)]:
        for offset in (0, 1, 5):
            chunk = data[offset : offset + n]
            assert _probes.crc32c(chunk, implementation="hardware") == _probes.crc32c(chunk, implementation="software"), (n, offset)


def test_extend_equals_whole(rng):
    data = rng.integers(0, 256, size=100_003, dtype=np.uint8).tobytes()
    whole = _probes.crc32c(data)
    for cut in (1, 4096, 50_000, 99_999):
        assert _probes.crc32c(data[cut:], crc=_probes.crc32c(data[:cut])) == whole


def test_bad_implementation_name():
    import peerstate

    with pytest.raises(peerstate.InvalidArgumentError, match="'auto', 'hardware' or 'software'"):
        _probes.crc32c(b"x", implementation="fast")
