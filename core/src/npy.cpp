#include "fusebox/core/npy.h"

#include <ATen/ATen.h>

#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "fusebox/core/safetensors.h"
#include "fusebox/core/zip_archive.h"
#include "fusebox/error.h"
#include "mapped_file.h"
#include "zip_reader.h"

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

uint64_t le(const char* p, int bytes) { return detail::little_endian(p, bytes); }

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

// With `unsigned_type`, a uint16/uint32 array is kept in its signed carrier (to be viewed like any
// other array), and `*unsigned_type` says the type it widens into (Undefined for other arrays).
void keep_carrier(Header& h, at::ScalarType* unsigned_type) {
  if (!unsigned_type) return;
  *unsigned_type = at::ScalarType::Undefined;
  if (h.carrier != at::ScalarType::Undefined)
    *unsigned_type = h.type, h.type = h.carrier, h.carrier = at::ScalarType::Undefined;
}

// The array of the .npy file in the `size` bytes at `bytes`; `keep`, when given, holds their
// memory for a tensor that views them.
at::Tensor npy_at(const char* bytes, uint64_t size, const std::string& where,
                  const std::shared_ptr<void>& keep, at::ScalarType* unsigned_type = nullptr) {
  Header h = decode(bytes, size, where);
  keep_carrier(h, unsigned_type);
  return tensor_of(h, bytes + h.data_offset, where, keep);
}

// ---- .npz: a zip archive of .npy files -------------------------------------------------------
// np.savez stores each entry as it is, so each array's bytes lie in the archive and are viewed in
// place (detail::zip_entries checks the rest); np.savez_compressed deflates them, and each is
// inflated into memory of its own, which its tensor then views.

// The arrays of the .npz archive in the `total` bytes at `p`, by name.
std::map<std::string, at::Tensor> npz_at(const char* p, uint64_t total, const std::string& where,
                                         const std::shared_ptr<void>& keep,
                                         UnsignedTypes* unsigned_types = nullptr) {
  if (unsigned_types) unsigned_types->clear();
  std::map<std::string, at::Tensor> out;
  const std::string bad = where + ": not a valid .npz file: ";
  for (const detail::ZipEntry& e : detail::zip_entries(p, total, bad)) {
    const bool npy = e.name.size() > 4 && e.name.compare(e.name.size() - 4, 4, ".npy") == 0;
    if (!npy) throw Error(bad + "it holds '" + e.name + "', which is not a .npy file");
    const std::string name = e.name.substr(0, e.name.size() - 4);
    at::ScalarType widens = at::ScalarType::Undefined;
    std::shared_ptr<void> content = keep;
    const char* bytes = p + e.offset;
    uint64_t size = e.size;
    if (!e.stored()) {
      std::shared_ptr<char> inflated = detail::inflate_entry(p, e, bad);
      bytes = inflated.get(), size = e.content_size, content = std::move(inflated);
    }
    at::Tensor t =
        npy_at(bytes, size, where + " '" + name + "'", content, unsigned_types ? &widens : nullptr);
    if (widens != at::ScalarType::Undefined) (*unsigned_types)[name] = widens;
    if (!out.emplace(name, std::move(t)).second)
      throw Error(bad + "it holds '" + e.name + "' twice");
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
  if (head.size() < 30 || !looks_like_zip(head)) return false;
  const uint64_t name_len = le(head.data() + 26, 2);
  return name_len > 4 && head.size() >= 30 + name_len &&
         head.compare(30 + name_len - 4, 4, ".npy") == 0;
}

std::map<std::string, at::Tensor> parse_npz(const std::string& bytes, const std::string& where) {
  return npz_at(bytes.data(), bytes.size(), where, nullptr);
}

std::map<std::string, at::Tensor> map_npz(const std::filesystem::path& path,
                                          UnsignedTypes* unsigned_types) {
  const std::string where = path.string();
  const std::shared_ptr<detail::MappedFile> file = detail::MappedFile::open(path, where);
  return npz_at(file->data(), file->size(), where, file, unsigned_types);
}

at::Tensor parse_npy(const std::string& bytes, const std::string& where) {
  return npy_at(bytes.data(), bytes.size(), where, nullptr);
}

at::Tensor map_raw_array(const std::filesystem::path& path, const std::string& dtype,
                         at::ScalarType* unsigned_type) {
  static const std::map<std::string, const char*> kNumpyNames = {
      {"uint16", "u2"}, {"uint32", "u4"}, {"int16", "i2"},   {"int32", "i4"},  {"int64", "i8"},
      {"uint8", "u1"},  {"int8", "i1"},   {"float32", "f4"}, {"float64", "f8"}};
  const std::string where = path.string();
  auto name = kNumpyNames.find(dtype);
  const Descr* d = nullptr;
  if (name != kNumpyNames.end())
    for (const Descr& k : kDescrs)
      if (std::strcmp(k.text, name->second) == 0) d = &k;
  if (!d)
    throw Error(where + ": '" + dtype +
                "' is not a type a headerless file is read as (uint16, uint32, int16, int32, "
                "int64, uint8, int8, float32, float64)");
  const std::shared_ptr<detail::MappedFile> file = detail::MappedFile::open(path, where);
  Header h;
  h.type = d->type, h.carrier = d->carrier;
  const at::ScalarType stored = h.carrier == at::ScalarType::Undefined ? h.type : h.carrier;
  const uint64_t item = c10::elementSize(stored);
  if (file->size() == 0) throw Error(where + " is empty: it holds no " + dtype + " value");
  if (file->size() % item != 0)
    throw Error(where + ": a headerless file of " + dtype + " values, and its " +
                std::to_string(file->size()) + " bytes are not a whole number of " +
                std::to_string(item) + "-byte values");
  h.shape = {static_cast<int64_t>(file->size() / item)};
  h.data_bytes = file->size();
  keep_carrier(h, unsigned_type);
  return tensor_of(h, file->data(), where, file);
}

at::Tensor map_npy(const std::filesystem::path& path, at::ScalarType* unsigned_type) {
  const std::string where = path.string();
  const std::shared_ptr<detail::MappedFile> file = detail::MappedFile::open(path, where);
  return npy_at(file->data(), file->size(), where, file, unsigned_type);
}

}  // namespace fusebox
