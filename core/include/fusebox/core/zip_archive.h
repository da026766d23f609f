// Zip archives as data files are (np.savez's .npz, torch.save's files): what zlib adds to reading
// them. np.savez and torch.save store their entries uncompressed and the readers view them in
// place without reading every byte, so their CRC-32s are only checked when asked for.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

namespace fusebox {

/// True if `head`, a file's first bytes, starts like a zip archive (a local file header).
bool looks_like_zip(const std::string& head);

/// Whether this build of fusebox has zlib: it reads np.savez_compressed archives (map_npz) and
/// checks CRC-32s (check_zip_crcs). Without it both are refused in one line.
bool zlib_available();

/// Reads every entry of the zip archive at `path` (mapped) and checks its content against the
/// CRC-32 and size its central directory declares, inflating compressed entries. Returns the
/// number of entries checked. Throws Error naming the file and the first entry that does not
/// match (a file damaged on disk or in transfer), a malformed archive, or a build without zlib.
int64_t check_zip_crcs(const std::filesystem::path& path);

}  // namespace fusebox
