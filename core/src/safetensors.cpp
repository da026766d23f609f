#include "fusebox/core/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <set>

#include "atomic_write.h"
#include "fusebox/core/checkpoint.h"
#include "fusebox/core/messages.h"
#include "fusebox/error.h"
#include "mapped_file.h"

namespace fusebox {

namespace fs = std::filesystem;

namespace {

// Larger headers are refused before they are read (the reference reader's limit is the same).
constexpr uint64_t kMaxHeaderBytes = 100u << 20;
constexpr size_t kMaxRank = 64;

struct DtypeName {
  const char* name;
  at::ScalarType type;
  /// For the unsigned types LibTorch lacks: the signed type of the same width that carries the
  /// file's bytes, each value then widened into `type` (U16 into int32, U32 into int64), so token
  /// ids of a 65k vocabulary read as they are. Undefined for the others.
  at::ScalarType carrier = at::ScalarType::Undefined;
  /// F8_E4M3 and F8_E5M2 (8-bit float weights): their bytes (carrier uint8) widened into bf16.
  detail::Float8 float8 = detail::Float8::kNone;
};
// The widened types come last: a tensor written out is I32, I64 or BF16, never U16, U32 or F8.
constexpr DtypeName kDtypes[] = {{"F64", at::kDouble},
                                 {"F32", at::kFloat},
                                 {"F16", at::kHalf},
                                 {"BF16", at::kBFloat16},
                                 {"I64", at::kLong},
                                 {"I32", at::kInt},
                                 {"I16", at::kShort},
                                 {"I8", at::kChar},
                                 {"U8", at::kByte},
                                 {"BOOL", at::kBool},
                                 {"U16", at::kInt, at::kShort},
                                 {"U32", at::kLong, at::kInt},
                                 {"F8_E4M3", at::kBFloat16, at::kByte, detail::Float8::kE4M3},
                                 {"F8_E5M2", at::kBFloat16, at::kByte, detail::Float8::kE5M2}};

const DtypeName* name_of(at::ScalarType type) {
  for (const DtypeName& d : kDtypes)
    if (d.type == type) return &d;
  return nullptr;
}

// The header's JSON, parsed by a small reader of our own: the header is a flat object of objects,
// strings and integer arrays, and a reader this size can be fuzzed whole (tests/fuzz).
struct Json {
  enum class Kind { Object, Array, String, Number } kind = Kind::Object;
  std::string text;  // String: its value; Number: its digits as written
  std::vector<std::pair<std::string, Json>> members;
  std::vector<Json> items;
};

class JsonParser {
 public:
  JsonParser(const std::string& s, std::string where) : s_(s), where_(std::move(where)) {}

  Json document() {
    Json v = value(0);
    skip_space();
    if (pos_ != s_.size()) fail("text after the header's object");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw Error(where_ + ": not a safetensors file: its header is not valid JSON (" + what +
                " at byte " + std::to_string(pos_) + " of the header)");
  }
  void skip_space() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r'))
      ++pos_;
  }
  char next() {
    if (pos_ >= s_.size()) fail("it ends early");
    return s_[pos_++];
  }
  void expect(char c) {
    skip_space();
    if (next() != c) fail(std::string("'") + c + "' expected");
  }

  Json value(int depth) {
    if (depth > 8) fail("nested too deep");
    skip_space();
    if (pos_ >= s_.size()) fail("it ends early");
    const char c = s_[pos_];
    Json v;
    if (c == '{') {
      ++pos_;
      std::set<std::string> seen;
      skip_space();
      if (pos_ < s_.size() && s_[pos_] == '}') return ++pos_, v;
      do {
        skip_space();
        if (next() != '"') fail("a name in quotes expected");
        std::string key = string();
        if (!seen.insert(key).second) fail("the name '" + key + "' given twice");
        expect(':');
        v.members.emplace_back(std::move(key), value(depth + 1));
        skip_space();
      } while (pos_ < s_.size() && s_[pos_] == ',' && ++pos_);
      expect('}');
    } else if (c == '[') {
      ++pos_;
      v.kind = Json::Kind::Array;
      skip_space();
      if (pos_ < s_.size() && s_[pos_] == ']') return ++pos_, v;
      do {
        v.items.push_back(value(depth + 1));
        skip_space();
      } while (pos_ < s_.size() && s_[pos_] == ',' && ++pos_);
      expect(']');
    } else if (c == '"') {
      ++pos_;
      v.kind = Json::Kind::String;
      v.text = string();
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      v.kind = Json::Kind::Number;
      v.text = number();
    } else {
      fail("unexpected character");  // true, false and null have no place in the header
    }
    return v;
  }

  // After the opening quote, up to and past the closing one.
  std::string string() {
    std::string out;
    for (;;) {
      const char c = next();
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("a control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      const char e = next();
      switch (e) {
        case '"':
        case '\\':
        case '/':
          out += e;
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xDC00 && cp <= 0xDFFF) fail("a lone low surrogate");
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (next() != '\\' || next() != 'u') fail("a high surrogate without its low one");
            const uint32_t low = hex4();
            if (low < 0xDC00 || low > 0xDFFF) fail("a high surrogate without its low one");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          }
          append_utf8(out, cp);
          break;
        }
        default:
          fail("an unknown escape");
      }
    }
  }
  uint32_t hex4() {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const char h = next();
      v <<= 4;
      if (h >= '0' && h <= '9')
        v |= static_cast<uint32_t>(h - '0');
      else if (h >= 'a' && h <= 'f')
        v |= static_cast<uint32_t>(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F')
        v |= static_cast<uint32_t>(h - 'A' + 10);
      else
        fail("a bad \\u escape");
    }
    return v;
  }
  static void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }
  // JSON's number grammar; only whole numbers are used (as_size checks that).
  std::string number() {
    const size_t start = pos_;
    auto digits = [&] {
      const size_t from = pos_;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
      if (pos_ == from) fail("a digit expected");
    };
    if (s_[pos_] == '-') ++pos_;
    digits();
    if (pos_ < s_.size() && s_[pos_] == '.') ++pos_, digits();
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      digits();
    }
    return s_.substr(start, pos_ - start);
  }

  const std::string& s_;
  const std::string where_;
  size_t pos_ = 0;
};

struct Entry {
  std::string name;
  at::ScalarType dtype;
  at::ScalarType carrier = at::ScalarType::Undefined;  ///< U16/U32/F8: the file's bytes
  detail::Float8 float8 = detail::Float8::kNone;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

struct Header {
  std::vector<Entry> entries;
  std::map<std::string, std::string> metadata;
};

// A non-negative whole number below 2^63, or Error.
uint64_t as_size(const Json& v, const std::string& what) {
  bool ok = v.kind == Json::Kind::Number && !v.text.empty() && v.text.size() <= 18 &&
            v.text.find_first_not_of("0123456789") == std::string::npos;
  if (!ok) throw Error(what + " is not a whole number of at most 18 digits");
  return std::stoull(v.text);
}

const Json* member(const Json& object, const std::string& key) {
  for (const auto& [k, v] : object.members)
    if (k == key) return &v;
  return nullptr;
}

// The entries of the header, every range inside a buffer of `buffer_bytes` and none overlapping.
Header decode_header(const std::string& json, uint64_t buffer_bytes, const std::string& where) {
  const Json root = JsonParser(json, where).document();
  const std::string bad = where + ": not a valid safetensors file: ";
  if (root.kind != Json::Kind::Object) throw Error(bad + "its header is not a JSON object");
  Header h;
  for (const auto& [name, v] : root.members) {
    if (name == "__metadata__") {
      if (v.kind != Json::Kind::Object) throw Error(bad + "__metadata__ is not an object");
      for (const auto& [k, s] : v.members) {
        if (s.kind != Json::Kind::String)
          throw Error(bad + "__metadata__ '" + k + "' is not a string");
        h.metadata[k] = s.text;
      }
      continue;
    }
    const std::string tensor = bad + "tensor '" + name + "': ";
    if (v.kind != Json::Kind::Object) throw Error(tensor + "its entry is not an object");
    const Json* dtype = member(v, "dtype");
    const Json* shape = member(v, "shape");
    const Json* offsets = member(v, "data_offsets");
    if (!dtype || !shape || !offsets || dtype->kind != Json::Kind::String ||
        shape->kind != Json::Kind::Array || offsets->kind != Json::Kind::Array ||
        offsets->items.size() != 2)
      throw Error(tensor +
                  "needs a dtype (a string), a shape (an array) and data_offsets (two "
                  "numbers)");
    Entry e;
    e.name = name;
    const auto* known = std::find_if(std::begin(kDtypes), std::end(kDtypes),
                                     [&](const DtypeName& d) { return dtype->text == d.name; });
    if (known == std::end(kDtypes))
      throw Error(tensor + "dtype '" + dtype->text +
                  "' is not one fusebox reads (F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I64, I32, "
                  "I16, I8, U8, U16, U32, BOOL)");
    e.dtype = known->type, e.carrier = known->carrier, e.float8 = known->float8;
    if (shape->items.size() > kMaxRank)
      throw Error(tensor + "has " + std::to_string(shape->items.size()) + " dimensions");
    uint64_t bytes = c10::elementSize(e.carrier == at::ScalarType::Undefined ? e.dtype : e.carrier);
    for (const Json& d : shape->items) {
      const uint64_t n = as_size(d, tensor + "a dimension");
      e.shape.push_back(static_cast<int64_t>(n));
      if (n != 0 && bytes > (uint64_t{1} << 62) / n)
        throw Error(tensor + "its shape holds more bytes than any file");
      bytes *= n;
    }
    e.begin = as_size(offsets->items[0], tensor + "a data offset");
    e.end = as_size(offsets->items[1], tensor + "a data offset");
    if (e.begin > e.end || e.end > buffer_bytes)
      throw Error(tensor + "its data_offsets [" + std::to_string(e.begin) + ", " +
                  std::to_string(e.end) + "] are not inside the " + std::to_string(buffer_bytes) +
                  " bytes of data (a truncated file?)");
    if (e.end - e.begin != bytes)
      throw Error(tensor + "its data_offsets span " + std::to_string(e.end - e.begin) +
                  " bytes, its dtype and shape need " + std::to_string(bytes));
    h.entries.push_back(std::move(e));
  }
  std::vector<const Entry*> by_offset;
  for (const Entry& e : h.entries) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const Entry* a, const Entry* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i)
    if (by_offset[i]->begin < by_offset[i - 1]->end)
      throw Error(bad + "the data of tensors '" + by_offset[i - 1]->name + "' and '" +
                  by_offset[i]->name + "' overlap");
  return h;
}

uint64_t read_le64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

// The header size of a file of `total` bytes whose first 8 bytes are `head`.
uint64_t header_size(const char* head, uint64_t total, const std::string& where) {
  if (total < 8)
    throw Error(where + ": not a safetensors file: shorter than its 8-byte header size");
  const uint64_t n = read_le64(head);
  if (n > kMaxHeaderBytes || n > total - 8)
    throw Error(where + ": not a safetensors file: its header size " + std::to_string(n) +
                " is larger than " +
                (n > kMaxHeaderBytes ? std::string("100 MiB") : "the file (a truncated file?)"));
  return n;
}

// Tensors of `h`, each filled by `read(offset in the data, bytes, destination)`.
std::map<std::string, at::Tensor> make_tensors(
    const Header& h, const std::string& where,
    const std::function<void(uint64_t, uint64_t, void*)>& read) {
  std::map<std::string, at::Tensor> out;
  for (const Entry& e : h.entries) {
    const bool widened = e.carrier != at::ScalarType::Undefined;
    at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(widened ? e.carrier : e.dtype));
    if (e.end > e.begin) read(e.begin, e.end - e.begin, t.data_ptr());
    if (e.float8 != detail::Float8::kNone)
      t = detail::widen_float8(t, e.float8);
    else if (widened)
      t = detail::widen_unsigned(t, e.dtype);
    if (e.dtype == at::kBool && !detail::valid_bools(t))
      throw Error(where + ": not a valid safetensors file: tensor '" + e.name +
                  "' is BOOL and holds a byte other than 0 or 1");
    out.emplace(e.name, std::move(t));
  }
  return out;
}

void append_json_string(std::string& out, const std::string& s) {
  out += '"';
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  out += '"';
}

}  // namespace

namespace {

// A safetensors file to be written: its first 8 bytes and header, then its tensors' bytes in
// order, each tensor brought to the CPU (and made contiguous) only when its bytes are written.
struct FileLayout {
  std::string head;                 // the header size and the header
  std::vector<at::Tensor> tensors;  // in the file's order
  uint64_t data_bytes = 0;
};

FileLayout layout_of(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                     const std::map<std::string, std::string>& metadata) {
  struct Item {
    std::string name;
    at::Tensor tensor;
    const DtypeName* dtype;
  };
  std::vector<Item> sorted;
  std::set<std::string> names;
  for (const auto& [name, t] : tensors) {
    if (name == "__metadata__" || !names.insert(name).second)
      throw Error("cannot write safetensors: the tensor name '" + name + "' is " +
                  (name == "__metadata__" ? "the format's own" : "given twice"));
    const DtypeName* known = name_of(t.scalar_type());
    if (!known)
      throw Error("cannot write safetensors: tensor '" + name + "' is " +
                  c10::toString(t.scalar_type()) + ", which the format has no name for");
    sorted.push_back({name, t.detach(), known});
  }
  // Larger elements first: with the header padded to 8 bytes, each tensor starts aligned.
  std::stable_sort(sorted.begin(), sorted.end(), [](const Item& a, const Item& b) {
    const size_t sa = a.tensor.element_size(), sb = b.tensor.element_size();
    return sa != sb ? sa > sb : a.name < b.name;
  });
  std::map<std::string, std::string> meta = metadata;
  meta.emplace("format", "pt");  // what Hugging Face's loaders look for
  std::string header = "{\"__metadata__\":{";
  for (auto it = meta.begin(); it != meta.end(); ++it) {
    if (it != meta.begin()) header += ',';
    append_json_string(header, it->first);
    header += ':';
    append_json_string(header, it->second);
  }
  header += '}';
  FileLayout out;
  for (const auto& [name, t, dtype] : sorted) {
    header += ',';
    append_json_string(header, name);
    header += ":{\"dtype\":\"" + std::string(dtype->name) + "\",\"shape\":[";
    for (int64_t d = 0; d < t.dim(); ++d) header += (d ? "," : "") + std::to_string(t.size(d));
    const uint64_t bytes = t.numel() * t.element_size();
    header += "],\"data_offsets\":[" + std::to_string(out.data_bytes) + "," +
              std::to_string(out.data_bytes + bytes) + "]}";
    out.data_bytes += bytes;
    out.tensors.push_back(t);
  }
  header += '}';
  header.append((8 - header.size() % 8) % 8, ' ');
  out.head.assign(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.head[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  out.head += header;
  return out;
}

// Hands the bytes of each tensor of `layout`, in order, to `write`.
void for_each_data(const FileLayout& layout,
                   const std::function<void(const char*, size_t)>& write) {
  for (const at::Tensor& t0 : layout.tensors) {
    const at::Tensor t = t0.to(at::kCPU).contiguous();
    if (t.numel() > 0) write(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size());
  }
}

}  // namespace

std::string encode_safetensors(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                               const std::map<std::string, std::string>& metadata) {
  const FileLayout layout = layout_of(tensors, metadata);
  std::string out;
  out.reserve(layout.head.size() + layout.data_bytes);
  out += layout.head;
  for_each_data(layout, [&](const char* p, size_t n) { out.append(p, n); });
  return out;
}

void save_safetensors(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const fs::path& path, const std::map<std::string, std::string>& metadata) {
  // Streamed into the file: no copy of the whole file is built in memory.
  const FileLayout layout = layout_of(tensors, metadata);
  detail::write_file_atomically_with(path, [&](int fd) -> const char* {
    const char* failed = detail::write_all(fd, layout.head.data(), layout.head.size());
    for_each_data(layout, [&](const char* p, size_t n) {
      if (!failed) failed = detail::write_all(fd, p, n);
    });
    return failed;
  });
}

std::map<std::string, at::Tensor> parse_safetensors(const std::string& bytes,
                                                    const std::string& where,
                                                    std::map<std::string, std::string>* metadata) {
  const uint64_t n = header_size(bytes.data(), bytes.size(), where);
  const Header h = decode_header(bytes.substr(8, n), bytes.size() - 8 - n, where);
  if (metadata) *metadata = h.metadata;
  const char* data = bytes.data() + 8 + n;
  return make_tensors(h, where, [&](uint64_t offset, uint64_t count, void* to) {
    std::memcpy(to, data + offset, count);
  });
}

std::map<std::string, at::Tensor> load_safetensors(const fs::path& path,
                                                   std::map<std::string, std::string>* metadata) {
  const std::string where = path.string();
  detail::require_regular_file(path);
  std::error_code ec;
  const uint64_t total = fs::file_size(path, ec);
  std::ifstream in(path, std::ios::binary);
  if (ec || !in) throw Error("cannot read " + where + ": " + std::strerror(errno));
  char head[8] = {};
  in.read(head, std::min<uint64_t>(8, total));
  const uint64_t n = header_size(head, total, where);
  std::string json(n, '\0');
  if (!in.read(json.data(), static_cast<std::streamsize>(n)))
    throw Error("cannot read " + where + ": it ended before its header did");
  const Header h = decode_header(json, total - 8 - n, where);
  if (metadata) *metadata = h.metadata;
  return make_tensors(h, where, [&](uint64_t offset, uint64_t count, void* to) {
    in.seekg(static_cast<std::streamoff>(8 + n + offset));
    if (!in.read(static_cast<char*>(to), static_cast<std::streamsize>(count)))
      throw Error("cannot read " + where + ": it ended early (did it change while being read?)");
  });
}

std::map<std::string, at::Tensor> map_safetensors(const fs::path& path,
                                                  std::map<std::string, std::string>* metadata,
                                                  UnsignedTypes* unsigned_types) {
  const std::string where = path.string();
  const std::shared_ptr<detail::MappedFile> mapping = detail::MappedFile::open(path, where);
  const uint64_t total = mapping->size();
  const uint64_t n = header_size(mapping->data(), total, where);
  Header h = decode_header(std::string(mapping->data() + 8, n), total - 8 - n, where);
  if (metadata) *metadata = h.metadata;
  if (unsigned_types) {
    // U16/U32 kept as their signed carriers, to be viewed like any other tensor.
    unsigned_types->clear();
    for (Entry& e : h.entries) {
      if (e.carrier == at::ScalarType::Undefined || e.float8 != detail::Float8::kNone) continue;
      (*unsigned_types)[e.name] = e.dtype;
      e.dtype = e.carrier, e.carrier = at::ScalarType::Undefined;
    }
  }
  const char* data = mapping->data() + 8 + n;
  // Aligned tensors view the mapping; the others (and those read as bools, which are checked)
  // are copied out.
  std::map<std::string, at::Tensor> out;
  Header copied;
  for (const Entry& e : h.entries) {
    const auto address = reinterpret_cast<uintptr_t>(data + e.begin);
    if (e.dtype == at::kBool || e.carrier != at::ScalarType::Undefined || e.end == e.begin ||
        address % c10::elementSize(e.dtype) != 0) {
      copied.entries.push_back(e);
      continue;
    }
    out.emplace(e.name, at::from_blob(
                            const_cast<char*>(data + e.begin), e.shape, [mapping](void*) {},
                            at::TensorOptions().dtype(e.dtype)));
  }
  for (auto& [name, t] : make_tensors(copied, where, [&](uint64_t offset, uint64_t count, void*to) {
         std::memcpy(to, data + offset, count);
       }))
    out.emplace(name, std::move(t));
  return out;
}

std::map<std::string, at::Tensor> map_safetensors_index(const fs::path& index) {
  return map_weights_index(index, [](const fs::path& file) { return map_safetensors(file); });
}

std::map<std::string, at::Tensor> map_weights_index(const fs::path& index,
                                                    const ShardReader& read_shard) {
  const std::string where = index.string();
  const std::string bad = where + ": not a " +
                          (is_safetensors_index_path(index) ? "safetensors" : "sharded weights") +
                          " index: ";
  detail::require_regular_file(index);
  std::error_code ec;
  const uint64_t size = fs::file_size(index, ec);
  if (ec || size > kMaxHeaderBytes) throw Error(bad + "larger than 100 MiB");
  std::ifstream in(index, std::ios::binary);
  std::string text(size, '\0');
  if (!in || !in.read(text.data(), static_cast<std::streamsize>(size)))
    throw Error("cannot read " + where + ": " + std::strerror(errno));
  const Json root = JsonParser(text, where).document();
  const Json* weight_map = root.kind == Json::Kind::Object ? member(root, "weight_map") : nullptr;
  if (!weight_map || weight_map->kind != Json::Kind::Object)
    throw Error(bad + "it has no \"weight_map\" object (tensor name -> file)");
  // Every shard once, mapped; each listed tensor from its shard.
  std::map<std::string, std::map<std::string, at::Tensor>> shards;
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, file] : weight_map->members) {
    if (file.kind != Json::Kind::String)
      throw Error(bad + "the file of '" + name + "' is not a string");
    const fs::path shard(file.text);
    // Hugging Face's indexes name files beside them; anything else could reach any file.
    if (shard.empty() || shard != shard.filename() || file.text == "." || file.text == "..")
      throw Error(bad + "'" + name + "' is in '" + file.text +
                  "', which is not a file name beside the index");
    auto it = shards.find(file.text);
    if (it == shards.end()) try {  // the index named the file: say so
        it = shards.emplace(file.text, read_shard(index.parent_path() / shard)).first;
      } catch (const Error& e) {
        throw Error(where + ": " + e.what());
      }
    auto t = it->second.find(name);
    if (t == it->second.end())
      throw Error(bad + "it puts '" + name + "' in " + file.text + ", which does not hold it");
    out.emplace(name, t->second);
  }
  // A shard's tensor the index does not list: files of two different models, or a stale index.
  for (const auto& [file, tensors] : shards)
    for (const auto& [name, t] : tensors)
      if (!out.count(name))
        throw Error(bad + file + " holds '" + name + "', which the index does not list");
  return out;
}

namespace {

bool ends_with(const fs::path& path, const std::string& suffix) {
  const std::string name = path.filename().string();
  return name.size() > suffix.size() &&
         name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

bool is_safetensors_index_path(const fs::path& path) {
  return ends_with(path, ".safetensors.index.json");
}

bool is_weights_index_path(const fs::path& path) {
  return is_safetensors_index_path(path) || ends_with(path, ".bin.index.json") ||
         ends_with(path, ".pt.index.json") || ends_with(path, ".pth.index.json");
}

bool is_safetensors_path(const fs::path& path) { return path.extension() == ".safetensors"; }

at::Tensor widen_unsigned(const at::Tensor& carrier, at::ScalarType type) {
  return detail::widen_unsigned(carrier, type);
}

bool looks_like_safetensors(const std::string& head) {
  return head.size() >= 9 && head[8] == '{' && read_le64(head.data()) <= kMaxHeaderBytes;
}

}  // namespace fusebox
