// The entries of a zip archive held in memory, as np.savez and torch.save write them: names and
// where each entry's bytes lie, so that a reader can view them in place. Every size and offset is
// checked against the archive's; ZIP64 sizes and offsets are read; encrypted and multi-disk
// archives are refused. A compressed entry's content is inflate_entry's to produce.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fusebox::detail {

struct ZipEntry {
  std::string name;
  uint64_t offset = 0;        ///< of the entry's data, from the archive's start
  uint64_t size = 0;          ///< of the data as stored (compressed, unless stored())
  uint16_t method = 0;        ///< 0 stored, 8 deflated; others are neither
  uint64_t content_size = 0;  ///< of the content, once inflated (the central directory's word)
  uint32_t crc32 = 0;         ///< of the content
  /// Whether its bytes are its content as they are (else they are compressed).
  bool stored() const { return method == 0; }
};

/// The entries of the archive in the `total` bytes at `p`, in the central directory's order.
/// Throws Error starting with `bad` ("x.npz: not a valid .npz file: ") and saying what is wrong.
std::vector<ZipEntry> zip_entries(const char* p, uint64_t total, const std::string& bad);

/// The content of the deflated entry `e` of the archive at `p`, inflated into memory of its own
/// and checked against the entry's size and CRC-32. Throws Error starting with `bad`.
std::shared_ptr<char> inflate_entry(const char* p, const ZipEntry& e, const std::string& bad);

/// The CRC-32 of the `n` bytes at `p` (zlib's; a build without zlib throws Error).
uint32_t crc32_of(const char* p, uint64_t n);

/// The little-endian unsigned number in the `bytes` bytes at `p`.
uint64_t little_endian(const char* p, int bytes);

}  // namespace fusebox::detail
