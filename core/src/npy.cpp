#include "fusebox/core/npy.h"

#include <ATen/ATen.h>

#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "fusebox/error.h"
#include "mapped_file.h"

namespace fusebox {

namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicBytes = 6;
constexpr size_t kMaxRank = 64;
constexpr uint64_t kMaxHeaderBytes = 1u << 20;  // numpy writes a few dozen bytes

// What numpy's descr names: the type read, and for uint16/uint32 the signed carrier of their bytes.
struct Descr {
  const char* text;  // without its byte-order character
  at::ScalarType type;
  at::ScalarType carrier = at::ScalarType::Undefined;
};
constexpr Descr kDescrs[] = {{"f8", at::kDouble},        {"f4", at::kFloat},
                             {"f2", at::kHalf},          {"i8", at::kLong},
                             {"i4", at::kInt},           {"i2", at::kShort},
                             {"i1", at::kChar},          {"u1", at::kByte},
                             {"b1", at::kBool},          {"u2", at::kInt, at::kShort},
                             {"u4", at::kLong, at::kInt}};

struct Header {
  at::ScalarType type = at::kFloat, carrier = at::ScalarType::Undefined;
  bool fortran_order = false;
  std::vector<int64_t> shape;
  uint64_t data_offset = 0;  // from the file's start
  uint64_t data_bytes = 0;
};

// The header dict: three keys numpy always writes, a value each, in any order.
class DictReader {
 public:
  DictReader(const std::string& text, std::string bad) : s_(text), bad_(std::move(bad)) {}

  Header read() {
    Header h;
    bool descr = false, order = false, shape = false;
    expect('{');
    while (!peek('}')) {
      const std::string key = quoted();
      expect(':');
      if (key == "descr") {
        if (peek('[')) fail("it holds a structured array (fields), which fusebox does not read");
        set_type(h, quoted()), descr = true;
      } else if (key == "fortran_order") {
        h.fortran_order = boolean(), order = true;
      } else if (key == "shape") {
        read_shape(h), shape = true;
      } else {
        fail("its header has the key '" + key + "', not one of descr, fortran_order, shape");
      }
      if (!peek('}')) expect(',');
    }
    expect('}');
    if (!descr || !order || !shape)
      fail("its header lacks " + std::string(!descr   ? "descr"
                                             : !order ? "fortran_order"
                                                      : "shape"));
    return h;
  }

 private:
  [[noreturn]] void fail(const std::string& why) const { throw Error(bad_ + why); }
  void skip() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\n')) ++pos_;
  }
  bool peek(char c) {
    skip();
    return pos_ < s_.size() && s_[pos_] == c;
  }
  void expect(char c) {
    if (!peek(c)) fail(std::string("its header is not a dict numpy writes (expected '") + c + "')");
    ++pos_;
  }
  std::string quoted() {
    skip();
    if (pos_ >= s_.size() || (s_[pos_] != '\'' && s_[pos_] != '"'))
      fail("its header is not a dict numpy writes (expected a quoted string)");
    const char quote = s_[pos_++];
    const size_t end = s_.find(quote, pos_);
    if (end == std::string::npos) fail("its header has an unterminated string");
    std::string out = s_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return out;
  }
  bool boolean() {
    skip();
    for (const auto& [word, value] : {std::pair{"True", true}, std::pair{"False", false}})
      if (s_.compare(pos_, std::strlen(word), word) == 0) {
        pos_ += std::strlen(word);
        return value;
      }
    fail("its fortran_order is neither True nor False");
  }
  void set_type(Header& h, const std::string& descr) {
    if (descr.size() >= 2 && descr[0] == '>' && descr != ">i1" && descr != ">u1" && descr != ">b1")
      fail("its dtype '" + descr +
           "' is big-endian; save it little-endian (array.astype(array.dtype.newbyteorder('<')))");
    const bool ordered = !descr.empty() && std::strchr("<|=>", descr[0]) != nullptr;
    const std::string bare = ordered ? descr.substr(1) : descr;
    for (const Descr& d : kDescrs)
      if (bare == d.text) {
        h.type = d.type, h.carrier = d.carrier;
        return;
      }
    fail("its dtype '" + descr +
         "' is not one fusebox reads (float64, float32, float16, int64, int32, int16, int8, "
         "uint8, uint16, uint32, bool)");
  }
  void read_shape(Header& h) {
    expect('(');
    while (!peek(')')) {
      skip();
      const size_t start = pos_;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
      // numpy may write a long as 3L (Python 2)
      const size_t digits = pos_ - start;
      if (pos_ < s_.size() && s_[pos_] == 'L') ++pos_;
      if (digits == 0 || digits > 18) fail("its shape holds something other than sizes");
      if (h.shape.size() == kMaxRank)
        fail("its shape has more than " + std::to_string(kMaxRank) + " dimensions");
      h.shape.push_back(std::stoll(s_.substr(start, digits)));
      if (!peek(')')) expect(',');
    }
    expect(')');
  }

  const std::string& s_;
  std::string bad_;
  size_t pos_ = 0;
};

// The little-endian unsigned number in the `bytes` bytes at `p`.
uint64_t le(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

// The header of the .npy file in the `total` bytes at `p`.
Header decode(const char* p, uint64_t total, const std::string& where) {
  const std::string bad = where + ": not a valid .npy file: ";
  if (total < kMagicBytes || std::memcmp(p, kMagic, kMagicBytes) != 0)
    throw Error(where + ": not a .npy file (no \\x93NUMPY magic string)");
  if (total < kMagicBytes + 2) throw Error(bad + "it ends inside its version");
  const int major = static_cast<unsigned char>(p[6]);
  if (major < 1 || major > 3)
    throw Error(bad + "format version " + std::to_string(major) + " is not 1, 2 or 3");
  const int size_bytes = major == 1 ? 2 : 4;
  const uint64_t prefix = kMagicBytes + 2 + size_bytes;
  if (total < prefix) throw Error(bad + "it ends inside its header size");
  const uint64_t length = le(p + 8, size_bytes);
  if (length > kMaxHeaderBytes || length > total - prefix)
    throw Error(bad + "its header size " + std::to_string(length) + " is larger than " +
                (length > kMaxHeaderBytes ? std::string("1 MiB") : "the file (a truncated file?)"));
  const std::string text(p + prefix, length);
  Header h = DictReader(text, bad).read();
  h.data_offset = prefix + length;
  const at::ScalarType stored = h.carrier == at::ScalarType::Undefined ? h.type : h.carrier;
  uint64_t bytes = c10::elementSize(stored);
  for (const int64_t n : h.shape) {
    if (n != 0 && bytes > (uint64_t{1} << 62) / static_cast<uint64_t>(n))
      throw Error(bad + "its shape holds more bytes than any file");
    bytes *= static_cast<uint64_t>(n);
  }
  h.data_bytes = bytes;
  const uint64_t present = total - h.data_offset;
  if (present != bytes)
    throw Error(bad + "its data are " + std::to_string(present) + " bytes, its dtype and shape " +
                "need " + std::to_string(bytes) + (present < bytes ? " (a truncated file?)" : ""));
  return h;
}

// Row-major strides, or column-major ones for a Fortran-ordered array.
std::vector<int64_t> strides_of(const Header& h) {
  std::vector<int64_t> strides(h.shape.size(), 1);
  const int64_t rank = static_cast<int64_t>(h.shape.size());
  if (h.fortran_order) {
    for (int64_t i = 1; i < rank; ++i)
      strides[i] = strides[i - 1] * std::max<int64_t>(h.shape[i - 1], 1);
  } else {
    for (int64_t i = rank - 2; i >= 0; --i)
      strides[i] = strides[i + 1] * std::max<int64_t>(h.shape[i + 1], 1);
  }
  return strides;
}

// The tensor of `h` whose bytes are at `data`: viewing them (`keep` holds their memory) when they
// can be used as they are, else copied (and widened, or checked as bools).
at::Tensor tensor_of(const Header& h, const char* data, const std::string& where,
                     const std::shared_ptr<void>& keep) {
  const bool widened = h.carrier != at::ScalarType::Undefined;
  const at::ScalarType stored = widened ? h.carrier : h.type;
  const std::vector<int64_t> strides = strides_of(h);
  const auto opts = at::TensorOptions().dtype(stored);
  at::Tensor t;
  const bool aligned = reinterpret_cast<uintptr_t>(data) % c10::elementSize(stored) == 0;
  if (keep && aligned && !widened && h.type != at::kBool && h.data_bytes > 0) {
    return at::from_blob(
        const_cast<char*>(data), h.shape, strides, [keep](void*) {}, opts);
  }
  t = at::empty_strided(h.shape, strides, opts);
  if (h.data_bytes > 0) std::memcpy(t.data_ptr(), data, h.data_bytes);
  if (h.type == at::kBool && !detail::valid_bools(t))
    throw Error(where + ": not a valid .npy file: a bool array holds a byte other than 0 or 1");
  return widened ? detail::widen_unsigned(t, h.type) : t;
}

// The array of the .npy file in the `size` bytes at `bytes`; `keep`, when given, holds their
// memory for a tensor that views them.
at::Tensor npy_at(const char* bytes, uint64_t size, const std::string& where,
                  const std::shared_ptr<void>& keep) {
  const Header h = decode(bytes, size, where);
  return tensor_of(h, bytes + h.data_offset, where, keep);
}

// ---- .npz: a zip archive of .npy files -------------------------------------------------------
// Only what np.savez writes is read: stored (uncompressed) entries, so that each array's bytes lie
// in the archive as they are and can be viewed in place; ZIP64 sizes and offsets (np.savez asks
// for them); no encryption, one disk. Every size and offset is checked against the archive's.

class ZipReader {
 public:
  ZipReader(const char* p, uint64_t total, std::string where)
      : p_(p),
        total_(total),
        where_(std::move(where)),
        bad_(where_ + ": not a valid .npz file: ") {}

  // Each entry's name and the range of its data in the archive.
  struct Entry {
    std::string name;
    uint64_t offset = 0, size = 0;
  };

  std::vector<Entry> entries() {
    uint64_t count = 0, dir = 0, dir_size = 0;
    end_of_directory(count, dir, dir_size);
    std::vector<Entry> out;
    uint64_t at = dir;
    for (uint64_t i = 0; i < count; ++i) {
      need(at, 46, "a central directory entry");
      if (le(p_ + at, 4) != 0x02014b50) fail("its central directory is malformed");
      const uint64_t flags = le(p_ + at + 8, 2), method = le(p_ + at + 10, 2);
      // A stored entry's compressed size is its size.
      uint64_t size = le(p_ + at + 20, 4), local = le(p_ + at + 42, 4);
      const uint64_t name_len = le(p_ + at + 28, 2), extra_len = le(p_ + at + 30, 2),
                     comment_len = le(p_ + at + 32, 2);
      need(at + 46, name_len + extra_len + comment_len, "a central directory entry");
      Entry e;
      e.name.assign(p_ + at + 46, name_len);
      if (flags & 1) fail("'" + e.name + "' is encrypted");
      if (method != 0)
        fail("'" + e.name +
             "' is compressed (np.savez_compressed); save the arrays with np.savez, which stores "
             "them as they are");
      // ZIP64: the fields at their maximum are in the extra field, in this order.
      const uint64_t usize = le(p_ + at + 24, 4);
      const bool big_usize = usize == 0xFFFFFFFF, big_size = size == 0xFFFFFFFF,
                 big_local = local == 0xFFFFFFFF;
      if (big_usize || big_size || big_local) {
        // Offsets, not pointers: a malformed length must not point outside the file.
        uint64_t x = at + 46 + name_len;
        const uint64_t x_end = x + extra_len;
        bool found = false;
        while (x + 4 <= x_end) {
          const uint64_t id = le(p_ + x, 2), len = le(p_ + x + 2, 2);
          if (x + 4 + len > x_end) break;
          if (id == 1) {
            uint64_t f = x + 4;
            const uint64_t f_end = f + len;
            auto field = [&](bool present, uint64_t& value) {
              if (!present) return;
              if (f + 8 > f_end) fail("'" + e.name + "' has a short ZIP64 field");
              value = le(p_ + f, 8), f += 8;
            };
            uint64_t ignored_usize = 0;
            field(big_usize, ignored_usize);
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
      if (le(p_ + local, 4) != 0x04034b50)
        fail("the local header of '" + e.name + "' is malformed");
      const uint64_t start = local + 30 + le(p_ + local + 26, 2) + le(p_ + local + 28, 2);
      need(start, size, "the data of '" + e.name + "'");
      e.offset = start, e.size = size;
      out.push_back(std::move(e));
      at += 46 + name_len + extra_len + comment_len;
    }
    return out;
  }

 private:
  [[noreturn]] void fail(const std::string& why) const { throw Error(bad_ + why); }
  // Refuses a range [at, at + n) that is not inside the archive.
  void need(uint64_t at, uint64_t n, const std::string& what) const {
    if (at > total_ || n > total_ - at)
      fail(what + " lies past the end of the file (a truncated file?)");
  }
  // The end of central directory record (and ZIP64's, when the archive has one).
  void end_of_directory(uint64_t& count, uint64_t& dir, uint64_t& dir_size) {
    if (total_ < 22) fail("it is shorter than a zip archive's end record");
    // The record is 22 bytes and a comment of at most 65535: search back from the end.
    const uint64_t lowest = total_ > 22 + 65535 ? total_ - 22 - 65535 : 0;
    uint64_t at = total_ - 22;
    while (le(p_ + at, 4) != 0x06054b50) {
      if (at == lowest) fail("it has no zip end record");
      --at;
    }
    if (le(p_ + at + 4, 2) != 0 || le(p_ + at + 6, 2) != 0) fail("it spans several disks");
    count = le(p_ + at + 10, 2), dir_size = le(p_ + at + 12, 4), dir = le(p_ + at + 16, 4);
    if (at >= 20 && le(p_ + at - 20, 4) == 0x07064b50) {  // the ZIP64 locator
      const uint64_t record = le(p_ + at - 20 + 8, 8);
      need(record, 56, "its ZIP64 end record");
      if (le(p_ + record, 4) != 0x06064b50) fail("its ZIP64 end record is malformed");
      count = le(p_ + record + 32, 8), dir_size = le(p_ + record + 40, 8),
      dir = le(p_ + record + 48, 8);
    }
    need(dir, dir_size, "its central directory");
    if (count > dir_size / 46) fail("its central directory is shorter than its entries");
  }

  const char* p_;
  uint64_t total_;
  std::string where_, bad_;
};

// The arrays of the .npz archive in the `total` bytes at `p`, by name.
std::map<std::string, at::Tensor> npz_at(const char* p, uint64_t total, const std::string& where,
                                         const std::shared_ptr<void>& keep) {
  std::map<std::string, at::Tensor> out;
  for (const ZipReader::Entry& e : ZipReader(p, total, where).entries()) {
    const bool npy = e.name.size() > 4 && e.name.compare(e.name.size() - 4, 4, ".npy") == 0;
    if (!npy)
      throw Error(where + ": not a valid .npz file: it holds '" + e.name +
                  "', which is not a .npy file");
    const std::string name = e.name.substr(0, e.name.size() - 4);
    at::Tensor t = npy_at(p + e.offset, e.size, where + " '" + name + "'", keep);
    if (!out.emplace(name, std::move(t)).second)
      throw Error(where + ": not a valid .npz file: it holds '" + e.name + "' twice");
  }
  if (out.empty()) throw Error(where + ": the .npz file holds no arrays");
  return out;
}

}  // namespace

bool looks_like_npy(const std::string& head) {
  return head.size() >= kMagicBytes && head.compare(0, kMagicBytes, kMagic) == 0;
}

bool looks_like_npz(const std::string& head) {
  // A zip archive whose first entry's name ends in .npy (np.savez writes nothing else).
  if (head.size() < 30 || le(head.data(), 4) != 0x04034b50) return false;
  const uint64_t name_len = le(head.data() + 26, 2);
  return name_len > 4 && head.size() >= 30 + name_len &&
         head.compare(30 + name_len - 4, 4, ".npy") == 0;
}

std::map<std::string, at::Tensor> parse_npz(const std::string& bytes, const std::string& where) {
  return npz_at(bytes.data(), bytes.size(), where, nullptr);
}

std::map<std::string, at::Tensor> map_npz(const std::filesystem::path& path) {
  const std::string where = path.string();
  const std::shared_ptr<detail::MappedFile> file = detail::MappedFile::open(path, where);
  return npz_at(file->data(), file->size(), where, file);
}

at::Tensor parse_npy(const std::string& bytes, const std::string& where) {
  return npy_at(bytes.data(), bytes.size(), where, nullptr);
}

at::Tensor map_npy(const std::filesystem::path& path) {
  const std::string where = path.string();
  const std::shared_ptr<detail::MappedFile> file = detail::MappedFile::open(path, where);
  return npy_at(file->data(), file->size(), where, file);
}

}  // namespace fusebox
