// VersionMeta: the description of one snapshot version, as a holder keeps it
// and as it travels between ranks (its encoding is the payload of the tcp
// transport's kMeta and kPutBegin frames, see net/wire.h).
//
// decode_meta() trusts nothing: counts and sizes are checked against the bytes
// that actually arrived before anything is allocated, and the layout is always
// rebuilt from the buffer list, never taken from the wire.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "store/layout.h"
#include "store/snapshot_store.h"

namespace peerstate {

// The description of one version that travels with it. The layout is rebuilt
// from buffers + chunk_bytes on arrival, never taken from the wire.
struct VersionMeta {
  int32_t source_rank = -1;
  int64_t version = -1;
  size_t chunk_bytes = 0;
  std::vector<BufferPlacement> buffers;  // name, nbytes, device, dtype (offsets from the layout)
  std::vector<uint32_t> checksums;       // one per chunk
  std::shared_ptr<const Layout> layout;
};

// The metadata of a committed snapshot of `source_rank`, as it travels.
VersionMeta meta_of(int32_t source_rank, const VersionView& view);

// Fills meta.layout from meta.buffers and meta.chunk_bytes; kProtocolError when
// the checksum count does not match the chunk count.
Status finish_meta(VersionMeta* meta);
std::string encode_meta(const VersionMeta& meta);
Status decode_meta(const std::string& bytes, VersionMeta* out);

}  // namespace peerstate
