#include "torch_save.h"

#include <ATen/ATen.h>
#include <caffe2/serialize/versions.h>
#include <torch/csrc/jit/serialization/unpickler.h>

#include <cstring>
#include <memory>
#include <unordered_map>
#include <vector>

#include "fusebox/error.h"
#include "mapped_file.h"
#include "zip_reader.h"

namespace fusebox::detail {

namespace {

// PyTorch's writer pads every record to start at a multiple of 64 bytes; a record that does not
// (another writer) is copied, so that no tensor is misaligned.
constexpr uintptr_t kRecordAlignment = 64;

// The format version in the record `text` ("3\n"), or 0 when it is not one LibTorch reads.
uint64_t format_version(const std::string& text) {
  uint64_t v = 0;
  size_t i = 0;
  for (; i < text.size() && i < 4 && text[i] >= '0' && text[i] <= '9'; ++i)
    v = v * 10 + (text[i] - '0');
  const bool rest_blank = text.find_first_not_of(" \r\n", i) == std::string::npos;
  if (i == 0 || !rest_blank || v < caffe2::serialize::kMinSupportedFileFormatVersion ||
      v > caffe2::serialize::kMaxSupportedFileFormatVersion)
    return 0;
  return v;
}

// Whether every element of `t` lies inside its storage (none does when it has no elements).
bool reaches_only_its_storage(const at::Tensor& t) {
  if (t.numel() == 0) return true;
  if (t.storage_offset() < 0) return false;
  // 128 bits: a crafted size times a crafted stride must not wrap around.
  constexpr __int128 kFar = __int128{1} << 100;
  __int128 last = t.storage_offset();  // the element furthest into the storage
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.stride(d) < 0) return false;
    last += static_cast<__int128>(t.size(d) - 1) * t.stride(d);
    if (last > kFar) return false;
  }
  return (last + 1) * t.element_size() <= static_cast<__int128>(t.storage().nbytes());
}

}  // namespace

std::optional<std::map<std::string, at::Tensor>> map_torch_archive(
    const std::filesystem::path& path) {
  const std::string where = path.string();
  std::shared_ptr<MappedFile> file;
  std::vector<ZipEntry> entries;
  try {
    file = MappedFile::open(path, where);
    entries = zip_entries(file->data(), file->size(), where + ": ");
  } catch (const Error&) {
    return std::nullopt;  // the usual reader names what is wrong with it
  }
  // Every record lies in the folder of the first (torch.save: the file's stem, or "archive").
  if (entries.empty()) return std::nullopt;
  const size_t slash = entries.front().name.find('/');
  if (slash == std::string::npos) return std::nullopt;
  const std::string folder = entries.front().name.substr(0, slash + 1);
  std::unordered_map<std::string, const ZipEntry*> records;
  for (const ZipEntry& e : entries) {
    if (e.name.compare(0, folder.size(), folder) != 0) continue;
    if (!e.stored()) return std::nullopt;  // a compressed record cannot be viewed
    records.emplace(e.name.substr(folder.size()), &e);
  }
  auto text_of = [&](const std::string& name) -> std::optional<std::string> {
    auto it = records.find(name);
    if (it == records.end() || it->second->size > 64) return std::nullopt;
    return std::string(file->data() + it->second->offset, it->second->size);
  };
  const std::optional<std::string> version =
      records.count(".data/version") ? text_of(".data/version") : text_of("version");
  const uint64_t format = version ? format_version(*version) : 0;
  const std::optional<std::string> order = text_of("byteorder");  // PyTorch 2.1 and later
  auto pickle = records.find("data.pkl");
  if (format == 0 || (records.count("byteorder") && order != std::string("little")) ||
      pickle == records.end())
    return std::nullopt;

  const char* pickle_bytes = file->data() + pickle->second->offset;
  const uint64_t pickle_size = pickle->second->size;
  uint64_t read = 0;
  auto reader = [&](char* buffer, size_t len) -> size_t {
    len = static_cast<size_t>(std::min<uint64_t>(len, pickle_size - read));
    std::memcpy(buffer, pickle_bytes + read, len);
    read += len;
    return len;
  };
  // Each storage's bytes: a view of the mapped record (holding the mapping), or a copy of an
  // unaligned one. Their sizes are kept, as the unpickler sizes a storage by the pickle alone.
  std::unordered_map<const void*, uint64_t> record_bytes;
  auto read_record = [&](const std::string& key) -> at::DataPtr {
    auto it = records.find("data/" + key);
    if (it == records.end())
      throw Error(where + ": its pickle names a storage '" + key + "' that it does not hold");
    char* bytes = file->data() + it->second->offset;
    const uint64_t size = it->second->size;
    at::DataPtr ptr;
    if (reinterpret_cast<uintptr_t>(bytes) % kRecordAlignment == 0) {
      auto* keep = new std::shared_ptr<MappedFile>(file);
      ptr = at::DataPtr(
          bytes, keep, [](void* k) { delete static_cast<std::shared_ptr<MappedFile>*>(k); },
          at::Device(at::kCPU));
    } else {
      ptr = at::getCPUAllocator()->allocate(size);
      if (size > 0) std::memcpy(ptr.get(), bytes, size);
    }
    record_bytes[ptr.get()] = size;
    return ptr;
  };
  torch::jit::Unpickler unpickler(reader, nullptr, nullptr, read_record, at::Device(at::kCPU));
  unpickler.set_version(format);
  const c10::IValue value = unpickler.parse_ivalue();

  std::map<std::string, at::Tensor> out;
  for (const auto& e : value.toGenericDict()) {
    const std::string& name = e.key().toStringRef();
    at::Tensor t = e.value().toTensor();
    // The unpickler sets each tensor's sizes and strides as the pickle says, unchecked: the bytes
    // it reaches must lie in its storage.
    if (t.defined() && !reaches_only_its_storage(t))
      throw Error(where + ": '" + name + "' (sizes " + c10::str(t.sizes()) + ", strides " +
                  c10::str(t.strides()) + ", offset " + std::to_string(t.storage_offset()) +
                  ") reaches past its storage of " + std::to_string(t.storage().nbytes()) +
                  " bytes");
    if (t.defined() && t.storage().nbytes() > 0) {
      auto it = record_bytes.find(t.storage().data());
      if (it == record_bytes.end() || t.storage().nbytes() > it->second)
        throw Error(where + ": '" + name + "' needs " + std::to_string(t.storage().nbytes()) +
                    " bytes of storage, and its record holds " +
                    (it == record_bytes.end() ? std::string("none") : std::to_string(it->second)));
    }
    out[name] = std::move(t);
  }
  return out;
}

}  // namespace fusebox::detail
