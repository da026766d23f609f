#include "zip_reader.h"

#include "fusebox/error.h"

namespace fusebox::detail {

uint64_t little_endian(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

namespace {

class ZipReader {
 public:
  ZipReader(const char* p, uint64_t total, const std::string& bad)
      : p_(p), total_(total), bad_(bad) {}

  std::vector<ZipEntry> entries() {
    uint64_t count = 0, dir = 0, dir_size = 0;
    end_of_directory(count, dir, dir_size);
    std::vector<ZipEntry> out;
    uint64_t at = dir;
    for (uint64_t i = 0; i < count; ++i) {
      need(at, 46, "a central directory entry");
      if (le(at, 4) != 0x02014b50) fail("its central directory is malformed");
      const uint64_t flags = le(at + 8, 2), method = le(at + 10, 2);
      uint64_t size = le(at + 20, 4), local = le(at + 42, 4);
      const uint64_t name_len = le(at + 28, 2), extra_len = le(at + 30, 2),
                     comment_len = le(at + 32, 2);
      need(at + 46, name_len + extra_len + comment_len, "a central directory entry");
      ZipEntry e;
      e.name.assign(p_ + at + 46, name_len);
      e.method = static_cast<uint16_t>(method);
      e.crc32 = static_cast<uint32_t>(le(at + 16, 4));
      if (flags & 1) fail("'" + e.name + "' is encrypted");
      // ZIP64: the fields at their maximum are in the extra field, in this order.
      const uint64_t usize = le(at + 24, 4);
      e.content_size = usize;
      const bool big_usize = usize == 0xFFFFFFFF, big_size = size == 0xFFFFFFFF,
                 big_local = local == 0xFFFFFFFF;
      if (big_usize || big_size || big_local) {
        // Offsets, not pointers: a malformed length must not point outside the file.
        uint64_t x = at + 46 + name_len;
        const uint64_t x_end = x + extra_len;
        bool found = false;
        while (x + 4 <= x_end) {
          const uint64_t id = le(x, 2), len = le(x + 2, 2);
          if (x + 4 + len > x_end) break;
          if (id == 1) {
            uint64_t f = x + 4;
            const uint64_t f_end = f + len;
            auto field = [&](bool present, uint64_t& value) {
              if (!present) return;
              if (f + 8 > f_end) fail("'" + e.name + "' has a short ZIP64 field");
              value = le(f, 8), f += 8;
            };
            field(big_usize, e.content_size);
            field(big_size, size);
            field(big_local, local);
            found = true;
            break;
          }
          x += 4 + len;
        }
        if (!found) fail("'" + e.name + "' lacks the ZIP64 sizes its entry points to");
      }
      need(local, 30, "the local header of '" + e.name + "'");
      if (le(local, 4) != 0x04034b50) fail("the local header of '" + e.name + "' is malformed");
      const uint64_t start = local + 30 + le(local + 26, 2) + le(local + 28, 2);
      need(start, size, "the data of '" + e.name + "'");
      e.offset = start, e.size = size;
      out.push_back(std::move(e));
      at += 46 + name_len + extra_len + comment_len;
    }
    return out;
  }

 private:
  uint64_t le(uint64_t at, int bytes) const { return little_endian(p_ + at, bytes); }
  [[noreturn]] void fail(const std::string& why) const { throw Error(bad_ + why); }
  // Refuses a range [at, at + n) that is not inside the archive.
  void need(uint64_t at, uint64_t n, const std::string& what) const {
    if (at > total_ || n > total_ - at)
      fail(what + " lies past the end of the file (a truncated file?)");
  }
  // The end of central directory record (and ZIP64's, when the archive has one).
  void end_of_directory(uint64_t& count, uint64_t& dir, uint64_t& dir_size) const {
    if (total_ < 22) fail("it is shorter than a zip archive's end record");
    // The record is 22 bytes and a comment of at most 65535: search back from the end.
    const uint64_t lowest = total_ > 22 + 65535 ? total_ - 22 - 65535 : 0;
    uint64_t at = total_ - 22;
    while (le(at, 4) != 0x06054b50) {
      if (at == lowest) fail("it has no zip end record");
      --at;
    }
    if (le(at + 4, 2) != 0 || le(at + 6, 2) != 0) fail("it spans several disks");
    count = le(at + 10, 2), dir_size = le(at + 12, 4), dir = le(at + 16, 4);
    if (at >= 20 && le(at - 20, 4) == 0x07064b50) {  // the ZIP64 locator
      const uint64_t record = le(at - 20 + 8, 8);
      need(record, 56, "its ZIP64 end record");
      if (le(record, 4) != 0x06064b50) fail("its ZIP64 end record is malformed");
      count = le(record + 32, 8), dir_size = le(record + 40, 8), dir = le(record + 48, 8);
    }
    need(dir, dir_size, "its central directory");
    if (count > dir_size / 46) fail("its central directory is shorter than its entries");
  }

  const char* p_;
  uint64_t total_;
  const std::string& bad_;
};

}  // namespace

std::vector<ZipEntry> zip_entries(const char* p, uint64_t total, const std::string& bad) {
  return ZipReader(p, total, bad).entries();
}

}  // namespace fusebox::detail
