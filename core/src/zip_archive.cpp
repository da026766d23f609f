// What zlib does for zip archives, when this build has it: deflated entries (np.savez_compressed)
// inflated, and CRC-32s checked. An entry's declared size is checked before anything is
// allocated: deflate cannot hold more than 1032 bytes per stored byte, so a crafted size cannot
// make a small file ask for all the memory.
#include <algorithm>
#include <limits>
#include <new>
#include <string>

#include "fusebox/core/zip_archive.h"
#include "fusebox/error.h"
#include "mapped_file.h"
#include "zip_reader.h"

#ifdef FUSEBOX_WITH_ZLIB
#include <zlib.h>
#endif

namespace fusebox {
namespace detail {

namespace {

// Refuses the content of `e` (`n` bytes at `p`) when it does not match the entry's CRC-32.
void check_crc(const char* p, uint64_t n, const ZipEntry& e, const std::string& bad) {
  if (crc32_of(p, n) != e.crc32)
    throw Error(bad + "'" + e.name + "' is damaged: its content does not match its CRC-32");
}

}  // namespace

#ifdef FUSEBOX_WITH_ZLIB

namespace {

// zlib counts in uInt: feed and take at most this many bytes at a time.
constexpr uint64_t kChunk = uint64_t{1} << 30;
// Deflate's best ratio (runs of one byte) is just under 1032:1.
constexpr uint64_t kMaxRatio = 1032;

// Inflates the raw deflate stream of `in_size` bytes at `in` into exactly `out_size` bytes at
// `out`; false when the stream is malformed or does not end there.
bool inflate_raw(const char* in, uint64_t in_size, char* out, uint64_t out_size) {
  z_stream z{};
  if (inflateInit2(&z, -MAX_WBITS) != Z_OK) return false;  // negative: no zlib header (zip's)
  uint64_t in_left = in_size, out_left = out_size;
  int rc = Z_OK;
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in));
  z.next_out = reinterpret_cast<Bytef*>(out);
  while (rc == Z_OK) {
    // Hand zlib the next chunk of whichever side it has used up.
    if (z.avail_in == 0) {
      z.avail_in = static_cast<uInt>(std::min(in_left, kChunk));
      in_left -= z.avail_in;
    }
    if (z.avail_out == 0) {
      z.avail_out = static_cast<uInt>(std::min(out_left, kChunk));
      out_left -= z.avail_out;
    }
    rc = inflate(&z, Z_NO_FLUSH);
    // No progress possible: the input ran out, or the content is longer than declared.
    if (rc == Z_BUF_ERROR && (in_left == 0 || out_left == 0)) break;
    if (rc == Z_BUF_ERROR) rc = Z_OK;
  }
  const bool whole = rc == Z_STREAM_END && z.avail_out == 0 && out_left == 0;
  inflateEnd(&z);
  return whole;
}

}  // namespace

uint32_t crc32_of(const char* p, uint64_t n) {
  uLong crc = crc32(0L, Z_NULL, 0);
  for (uint64_t at = 0; at < n; at += kChunk)  // in chunks zlib can count
    crc = crc32(crc, reinterpret_cast<const Bytef*>(p + at),
                static_cast<uInt>(std::min(n - at, kChunk)));
  return static_cast<uint32_t>(crc);
}

std::shared_ptr<char> inflate_entry(const char* p, const ZipEntry& e, const std::string& bad) {
  const std::string name = "'" + e.name + "'";
  if (e.method != 8)
    throw Error(bad + name + " is compressed with method " + std::to_string(e.method) +
                ", not deflate (the only one read)");
  if (e.size > (std::numeric_limits<uint64_t>::max() - 1024) / kMaxRatio ||
      e.content_size > e.size * kMaxRatio + 1024)
    throw Error(bad + name + " claims " + std::to_string(e.content_size) + " bytes from " +
                std::to_string(e.size) + " compressed, more than deflate can hold");
  std::shared_ptr<char> out(new (std::nothrow) char[std::max<uint64_t>(e.content_size, 1)],
                            std::default_delete<char[]>());
  if (!out)
    throw Error(bad + name + " needs " + std::to_string(e.content_size) +
                " bytes of memory to inflate, which could not be allocated");
  if (!inflate_raw(p + e.offset, e.size, out.get(), e.content_size))
    throw Error(bad + name + " is damaged: its deflated data do not inflate into the " +
                std::to_string(e.content_size) + " bytes it declares (a truncated file?)");
  check_crc(out.get(), e.content_size, e, bad);
  return out;
}

#else  // built without zlib

std::shared_ptr<char> inflate_entry(const char*, const ZipEntry& e, const std::string& bad) {
  throw Error(bad + "'" + e.name +
              "' is compressed, and this fusebox was built without zlib (install zlib's "
              "headers, e.g. zlib1g-dev, and rebuild; or store the entries uncompressed)");
}

uint32_t crc32_of(const char*, uint64_t) {
  throw Error("CRC-32s are not checked: this fusebox was built without zlib");
}

#endif

}  // namespace detail

bool looks_like_zip(const std::string& head) { return head.rfind("PK\x03\x04", 0) == 0; }

bool zlib_available() {
#ifdef FUSEBOX_WITH_ZLIB
  return true;
#else
  return false;
#endif
}

int64_t check_zip_crcs(const std::filesystem::path& path) {
  const std::string where = path.string();
  if (!zlib_available())
    throw Error(where + ": its CRC-32s cannot be checked: this fusebox was built without zlib");
  const std::shared_ptr<detail::MappedFile> file = detail::MappedFile::open(path, where);
  const std::string bad = where + ": ";
  const std::vector<detail::ZipEntry> entries =
      detail::zip_entries(file->data(), file->size(), bad);
  for (const detail::ZipEntry& e : entries) {
    if (!e.stored()) {
      detail::inflate_entry(file->data(), e, bad);  // checks the size and CRC-32 itself
      continue;
    }
    if (e.size != e.content_size)
      throw Error(bad + "'" + e.name + "' is damaged: it is stored in " + std::to_string(e.size) +
                  " bytes and declares " + std::to_string(e.content_size));
    detail::check_crc(file->data() + e.offset, e.size, e, bad);
  }
  return static_cast<int64_t>(entries.size());
}

}  // namespace fusebox
