// Content fingerprints: FNV-1a, the 64-bit hash that checkpoints are checksummed with, and a
// cheap fingerprint of a file (a training data file, so that a resumed run can tell that its
// data changed since the checkpoint was written).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fusebox {

/// FNV-1a over `n` bytes, continuing from `h` (the offset basis starts a new hash).
uint64_t fnv1a(const void* data, size_t n, uint64_t h = 14695981039346656037ULL);

/// What file_fingerprint() found.
struct FileFingerprint {
  uint64_t size = 0;     ///< bytes
  uint64_t hash = 0;     ///< FNV-1a of the size and the bytes read
  bool sampled = false;  ///< true: the hash read blocks of 64 KiB spread over the file
  /// "SIZE:HASH" (hexadecimal), with "~" before the hash when sampled; read back by parse().
  std::string text() const;
  static bool parse(const std::string& text, FileFingerprint& out);
  bool operator==(const FileFingerprint& o) const {
    return size == o.size && hash == o.hash && sampled == o.sampled;
  }
};

/// The fingerprint of the file at `path`: its size and a hash of all its bytes up to 2 x `blocks`
/// x 64 KiB (8 MiB for the default 64), or of `blocks` (at least 2) blocks of 64 KiB spread
/// evenly from its first byte to its last beyond that (4 MiB read whatever the size, so a dataset
/// of any size costs milliseconds; a change confined to bytes between the blocks goes unseen, one
/// that changes the size never). A caller fingerprinting many files gives each fewer blocks.
/// Throws Error naming the file when it cannot be read.
FileFingerprint file_fingerprint(const std::string& path, uint64_t blocks = 64);

}  // namespace fusebox
