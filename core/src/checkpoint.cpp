#include "fusebox/core/checkpoint.h"
#include "fusebox/core/fingerprint.h"
#include "fusebox/core/messages.h"

#include "fusebox/core/step_mode.h"

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <ATen/core/grad_mode.h>
#include <caffe2/serialize/inline_container.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <regex>
#include <set>
#include <string_view>

#include "atomic_write.h"
#include "mapped_file.h"
#include "torch_save.h"

namespace fusebox {

namespace fs = std::filesystem;

namespace {

constexpr char kMagic[12] = {'F', 'U', 'S', 'E', 'B', 'O', 'X', '-', 'C', 'K', 'P', 'T'};
// Version 2 (fusebox 0.7) aligns each tensor's data to 64 bytes of the file, so that a loaded
// checkpoint's tensors view the mapped file; version 1 files are still read (copied).
constexpr uint32_t kFormatVersion = 2;
constexpr size_t kHeaderSize = sizeof(kMagic) + 4 + 8 + 8;
constexpr uint64_t kTensorAlignment = 64;

// The zero bytes that bring a tensor's data starting `at` bytes into the file to the alignment.
uint64_t padding_at(uint64_t at) {
  return (kTensorAlignment - at % kTensorAlignment) % kTensorAlignment;
}
// The checksum's FNV-1a starts from the standard offset basis short of its last digit (an early
// slip). It is as good a start as any, and every checkpoint written so far was summed from it, so
// it stays: changing it would make every existing checkpoint read as corrupt.
constexpr uint64_t kChecksumBasis = 1469598103934665603ULL;

// The checkpoint in `bytes`, checked; `where` names it in errors. With `keep` (the mapped file
// holding `bytes`), aligned tensors view the bytes and hold `keep`; without, they are copied.
Checkpoint parse_payload(std::string_view bytes, const std::string& where,
                         const std::shared_ptr<void>& keep);

template <class T>
void put(std::string& out, T v) {
  char buf[sizeof(T)];
  std::memcpy(buf, &v, sizeof(T));  // little-endian hosts only (x86-64, aarch64)
  out.append(buf, sizeof(T));
}

template <class T>
T get(std::string_view in, size_t offset) {
  T v;
  std::memcpy(&v, in.data() + offset, sizeof(T));
  return v;
}

// What an entry of the payload holds.
enum class Section : uint8_t {
  Model = 0,
  Optimizer = 1,
  Rng = 2,
  Meta = 3,
  Counter = 4,
  Buffer = 5,
  Ema = 6  // added in fusebox 0.2; older readers refuse it as an unknown section
};

// A bounds-checked cursor over an untrusted payload: every length is checked against what is
// left before it is used, so a crafted file gives an Error, never an out-of-bounds read.
struct Reader {
  std::string_view data;
  size_t pos;
  const std::string& where;
  uint32_t version;
  std::shared_ptr<void> keep;  ///< the mapped file, for tensors that view it

  [[noreturn]] void fail(const std::string& why) const {
    throw Error(where + " cannot be decoded (" + why + " at byte " + std::to_string(pos) +
                "); use an earlier checkpoint");
  }
  void need(uint64_t n) const {
    if (n > data.size() - pos) fail("entry runs past the end of the file");
  }
  template <class T>
  T get() {
    need(sizeof(T));
    T v = ::fusebox::get<T>(data, pos);
    pos += sizeof(T);
    return v;
  }
  std::string bytes(uint64_t n) {
    need(n);
    std::string s(data.substr(pos, n));
    pos += n;
    return s;
  }
  at::Tensor tensor() {
    const auto type = static_cast<at::ScalarType>(get<uint8_t>());
    switch (type) {
      case at::kByte:
      case at::kChar:
      case at::kShort:
      case at::kInt:
      case at::kLong:
      case at::kHalf:
      case at::kFloat:
      case at::kDouble:
      case at::kBool:
      case at::kBFloat16:
        break;
      default:
        fail("unsupported tensor dtype " + std::to_string(static_cast<int>(type)));
    }
    const uint8_t ndim = get<uint8_t>();
    if (ndim > 64) fail("tensor with " + std::to_string(ndim) + " dimensions");
    std::vector<int64_t> sizes;
    uint64_t numel = 1;
    for (uint8_t d = 0; d < ndim; ++d) {
      const int64_t n = get<int64_t>();
      if (n < 0 || (n > 0 && numel > (uint64_t{1} << 48) / static_cast<uint64_t>(n)))
        fail("bad tensor size");
      sizes.push_back(n);
      numel *= static_cast<uint64_t>(n);
    }
    const uint64_t nbytes = get<uint64_t>();
    if (nbytes != numel * c10::elementSize(type))
      fail("tensor byte count does not match its shape");
    if (version >= 2 && nbytes > 0) {
      const uint64_t pad = padding_at(pos);
      need(pad);
      pos += pad;
    }
    need(nbytes);
    const char* at = data.data() + pos;
    pos += nbytes;
    const auto options = at::TensorOptions().dtype(type);
    // A view of the mapped file: restoring copies it where it belongs (parameters, the
    // optimizers' own state), so resuming holds no copy of the checkpoint beside them, only
    // the file's pages, which the system may drop again.
    if (keep && nbytes > 0 && reinterpret_cast<uintptr_t>(at) % kTensorAlignment == 0)
      return at::from_blob(
          const_cast<char*>(at), sizes, [keep = keep](void*) {}, options);
    at::Tensor t = at::empty(sizes, options);
    if (nbytes > 0) std::memcpy(t.data_ptr(), at, nbytes);  // empty: no storage
    return t;
  }
};

std::map<std::string, at::Tensor> tensor_map(const c10::IValue& v) {
  std::map<std::string, at::Tensor> out;
  for (const auto& e : v.toGenericDict()) out[e.key().toStringRef()] = e.value().toTensor();
  return out;
}

std::string read_all(const fs::path& path, const std::string& what) {
  std::error_code ec;
  if (!fs::exists(path, ec)) throw Error(what + " " + path.string() + does_not_exist(ec));
  if (fs::is_directory(path, ec)) throw Error(what + " " + path.string() + " is a directory");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("cannot read " + what + " " + path.string() + ": " + std::strerror(errno));
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace

const char* detail::write_all(int fd, const char* p, size_t n) {
  size_t done = 0;
  while (done < n) {
    const ssize_t k = ::write(fd, p + done, n - done);
    if (k < 0) {
      if (errno == EINTR) continue;
      return "write";
    }
    done += static_cast<size_t>(k);
  }
  return nullptr;
}

namespace {

// Writes all of `bytes` to `fd` and fsyncs it. Returns nullptr, or the call that failed
// ("write", "fsync") with errno set by it.
const char* write_and_sync(int fd, const std::string& bytes) {
  if (const char* failed = detail::write_all(fd, bytes.data(), bytes.size())) return failed;
  return ::fsync(fd) == 0 ? nullptr : "fsync";
}

}  // namespace

void append_to_file(const fs::path& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    const std::string reason = std::strerror(errno);
    throw Error("cannot write " + path.string() + " (" + reason +
                "); check that the folder exists and is writable");
  }
  const off_t before = ::lseek(fd, 0, SEEK_END);
  auto fail = [&](const std::string& what) {
    const std::string reason = std::strerror(errno);
    if (before >= 0 && ::ftruncate(fd, before) != 0) {
      // Nothing more to do: the caller's error says the file is incomplete.
    }
    ::close(fd);
    throw Error("cannot write " + path.string() + ": " + what + " failed (" + reason +
                "); check that the folder is writable and has space");
  };
  if (const char* failed = write_and_sync(fd, bytes)) fail(failed);
  if (::close(fd) != 0) {
    const std::string reason = std::strerror(errno);
    throw Error("cannot write " + path.string() + ": close failed (" + reason + ")");
  }
}

void write_file_atomically(const fs::path& path, const std::string& bytes) {
  detail::write_file_atomically_with(
      path, [&](int fd) { return detail::write_all(fd, bytes.data(), bytes.size()); });
}

void detail::write_file_atomically_with(const fs::path& path,
                                        const std::function<const char*(int)>& write) {
  const fs::path tmp = temporary_path(path), dir = tmp.parent_path();
  auto fail = [&](const std::string& what) {
    const std::string reason = std::strerror(errno);
    ::unlink(tmp.c_str());
    throw Error("cannot write " + path.string() + ": " + what + " failed (" + reason +
                "); check that the folder exists, is writable and has space");
  };
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    const std::string reason = std::strerror(errno);
    throw Error("cannot write " + path.string() + ": cannot create a file in " + dir.string() +
                " (" + reason + "); check that the folder exists and is writable");
  }
  // Held until close (or this process's death): remove_stale_temporaries leaves a locked
  // temporary alone, also one whose writer's pid it cannot see (another PID namespace).
  ::flock(fd, LOCK_EX | LOCK_NB);
  const char* failed = nullptr;
  try {
    failed = write(fd);
  } catch (...) {  // what made the bytes failed: no temporary is left behind
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (!failed && ::fsync(fd) != 0) failed = "fsync";
  if (failed) {
    const int error = errno;  // close may change it
    ::close(fd);
    errno = error;
    fail(failed);
  }
  if (::close(fd) != 0) fail("close");
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail("rename");
  // Persist the rename itself.
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

namespace {

// Where a checkpoint's payload goes as it is encoded: counted and summed (FNV-1a) as it passes,
// small pieces gathered into a buffer, a tensor's bytes handed on as they are. Without a sink it
// only counts (to size a buffer before anything is copied).
class PayloadWriter {
 public:
  using Sink = std::function<void(const char*, size_t)>;
  explicit PayloadWriter(Sink sink = nullptr) : sink_(std::move(sink)) {}
  bool counting() const { return !sink_; }
  template <class T>
  void put(T v) {
    char buf[sizeof(T)];
    std::memcpy(buf, &v, sizeof(T));  // little-endian hosts only (x86-64, aarch64)
    append(buf, sizeof(T));
  }
  void append(const void* p, size_t n) {
    size_ += n;
    if (counting() || n == 0) return;
    hash_ = fnv1a(p, n, hash_);
    if (buffer_.size() + n > kBuffer) flush();
    if (n >= kBuffer)
      sink_(static_cast<const char*>(p), n);
    else
      buffer_.append(static_cast<const char*>(p), n);
  }
  void skip(uint64_t n) { size_ += n; }  // counting: bytes not looked at
  void pad(uint64_t n) {
    static const char zeros[kTensorAlignment] = {};
    append(zeros, n);
  }
  void flush() {
    if (!buffer_.empty()) sink_(buffer_.data(), buffer_.size());
    buffer_.clear();
  }
  uint64_t size() const { return size_; }
  uint64_t hash() const { return hash_; }

 private:
  static constexpr size_t kBuffer = size_t{1} << 20;
  Sink sink_;
  std::string buffer_;
  uint64_t size_ = 0, hash_ = kChecksumBasis;
};

// The payload of `ckpt` into `out`. Each tensor is brought to the CPU (and made contiguous) alone,
// as it is written, so that writing holds no copy of more than one tensor.
void encode_payload(const Checkpoint& ckpt, PayloadWriter& out) {
  const uint64_t entries = ckpt.model.size() + ckpt.buffers.size() + ckpt.optimizer.size() +
                           ckpt.rng.size() + ckpt.meta.size() + ckpt.counters.size() +
                           ckpt.ema.size();
  out.put<uint64_t>(entries);
  auto key = [&](Section s, const std::string& k) {
    out.put<uint8_t>(static_cast<uint8_t>(s));
    out.put<uint32_t>(static_cast<uint32_t>(k.size()));
    out.append(k.data(), k.size());
  };
  auto tensor = [&](const at::Tensor& t0) {
    out.put<uint8_t>(static_cast<uint8_t>(t0.scalar_type()));
    out.put<uint8_t>(static_cast<uint8_t>(t0.dim()));
    for (int64_t d : t0.sizes()) out.put<int64_t>(d);
    const uint64_t nbytes = static_cast<uint64_t>(t0.numel()) * t0.element_size();
    out.put<uint64_t>(nbytes);
    if (nbytes == 0) return;
    out.pad(padding_at(kHeaderSize + out.size()));
    if (out.counting()) return out.skip(nbytes);
    const at::Tensor t = t0.detach().to(at::kCPU).contiguous();
    out.append(t.data_ptr(), nbytes);
  };
  for (const auto& [k, v] : ckpt.model) key(Section::Model, k), tensor(v);
  for (const auto& [k, v] : ckpt.buffers) key(Section::Buffer, k), tensor(v);
  for (const auto& [k, v] : ckpt.ema) key(Section::Ema, k), tensor(v);
  for (const auto& [k, v] : ckpt.optimizer) key(Section::Optimizer, k), tensor(v);
  for (const auto& [k, v] : ckpt.rng) key(Section::Rng, k), tensor(v);
  for (const auto& [k, v] : ckpt.meta) {
    key(Section::Meta, k);
    out.put<uint32_t>(static_cast<uint32_t>(v.size()));
    out.append(v.data(), v.size());
  }
  for (const auto& [k, v] : ckpt.counters) key(Section::Counter, k), out.put<int64_t>(v);
  if (!out.counting()) out.flush();
}

// The header of a payload of `size` bytes whose checksum is `hash`.
std::string header_of(uint64_t size, uint64_t hash) {
  std::string bytes(kMagic, sizeof(kMagic));
  put<uint32_t>(bytes, kFormatVersion);
  put<uint64_t>(bytes, size);
  put<uint64_t>(bytes, hash);
  return bytes;
}

}  // namespace

void save_checkpoint(const Checkpoint& ckpt, const fs::path& path) {
  // Streamed into the file: a header to be filled in, then the payload as it is encoded, then the
  // header with its size and checksum. Memory: a buffer and one tensor's CPU copy at a time, not
  // a copy of the whole checkpoint.
  detail::write_file_atomically_with(path, [&](int fd) -> const char* {
    const char* failed = detail::write_all(fd, std::string(kHeaderSize, '\0').data(), kHeaderSize);
    PayloadWriter out([&](const char* p, size_t n) {
      if (!failed) failed = detail::write_all(fd, p, n);
    });
    if (!failed) encode_payload(ckpt, out);
    if (failed) return failed;
    const std::string header = header_of(out.size(), out.hash());
    return ::pwrite(fd, header.data(), header.size(), 0) == static_cast<ssize_t>(header.size())
               ? nullptr
               : "write";
  });
}

std::string encode_checkpoint(const Checkpoint& ckpt) {
  PayloadWriter count;
  encode_payload(ckpt, count);
  std::string bytes(kHeaderSize, '\0');
  bytes.reserve(kHeaderSize + count.size());  // one buffer of the checkpoint's size
  PayloadWriter out([&](const char* p, size_t n) { bytes.append(p, n); });
  encode_payload(ckpt, out);
  bytes.replace(0, kHeaderSize, header_of(out.size(), out.hash()));
  return bytes;
}

Checkpoint load_checkpoint(const fs::path& path) {
  // Mapped, not read: its tensors view the file's pages (copy-on-write), which the system may
  // drop again, so loading allocates no memory for them (files of format version 1, whose tensors
  // are not aligned, are copied out).
  const std::string what = "checkpoint " + path.string();
  std::error_code ec;
  if (!fs::exists(path, ec)) throw Error(what + does_not_exist(ec));
  if (fs::is_directory(path, ec)) throw Error(what + " is a directory");
  const std::shared_ptr<detail::MappedFile> file = detail::MappedFile::open(path, what);
  return parse_payload(std::string_view(file->data(), file->size()), what, file);
}

Checkpoint parse_checkpoint(const std::string& bytes, const std::string& where) {
  return parse_payload(bytes, where, nullptr);
}

namespace {

Checkpoint parse_payload(std::string_view bytes, const std::string& where,
                         const std::shared_ptr<void>& keep) {
  if (bytes.size() < kHeaderSize || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0)
    throw Error(where + " is not a fusebox checkpoint (bad header); pass a checkpoint-*.fbx file");
  const uint32_t version = get<uint32_t>(bytes, sizeof(kMagic));
  if (version < 1 || version > kFormatVersion)
    throw Error(where + " has format version " + std::to_string(version) +
                "; this fusebox reads 1 to " + std::to_string(kFormatVersion) +
                " (a checkpoint of a newer fusebox?)");
  const uint64_t size = get<uint64_t>(bytes, sizeof(kMagic) + 4);
  const uint64_t sum = get<uint64_t>(bytes, sizeof(kMagic) + 12);
  if (bytes.size() - kHeaderSize != size)
    throw Error(where + " is truncated or padded (" + std::to_string(bytes.size() - kHeaderSize) +
                " payload bytes, header says " + std::to_string(size) +
                "); use an earlier checkpoint");
  if (fnv1a(bytes.data() + kHeaderSize, size, kChecksumBasis) != sum)
    throw Error(where + " is corrupt (checksum mismatch); use an earlier checkpoint");
  Checkpoint out;
  Reader in{bytes, kHeaderSize, where, version, keep};
  const uint64_t entries = in.get<uint64_t>();
  for (uint64_t e = 0; e < entries; ++e) {
    const uint8_t section = in.get<uint8_t>();
    const std::string k = in.bytes(in.get<uint32_t>());
    switch (static_cast<Section>(section)) {
      case Section::Model:
        out.model[k] = in.tensor();
        break;
      case Section::Buffer:
        out.buffers[k] = in.tensor();
        break;
      case Section::Ema:
        out.ema[k] = in.tensor();
        break;
      case Section::Optimizer:
        out.optimizer[k] = in.tensor();
        break;
      case Section::Rng:
        out.rng[k] = in.tensor();
        break;
      case Section::Meta:
        out.meta[k] = in.bytes(in.get<uint32_t>());
        break;
      case Section::Counter:
        out.counters[k] = in.get<int64_t>();
        break;
      default:
        in.fail("unknown section " + std::to_string(section));
    }
  }
  if (in.pos != bytes.size()) in.fail("trailing bytes");
  return out;
}

}  // namespace

StateDict merged_optimizer_state(const std::vector<std::shared_ptr<Optimizer>>& optimizers) {
  StateDict out = optimizer_state_now(optimizers);
  for (auto& [k, v] : out) v = v.detach().clone();
  return out;
}

StateDict optimizer_state_now(const std::vector<std::shared_ptr<Optimizer>>& optimizers) {
  StateDict out;
  for (const auto& opt : optimizers)
    for (const auto& [k, v] : opt->state_dict()) out[k] = v;
  return out;
}

StateDict owned_optimizer_state(const StateDict& merged, const std::vector<ParamGroup>& groups,
                                int rank, int world) {
  // The step modes shard over all parameters as one list, in order (see state_sharding.cpp).
  ParamGroup all;
  std::vector<std::string> names;
  for (const auto& g : groups)
    for (size_t i = 0; i < g.params.size(); ++i) {
      all.params.push_back(g.params[i]);
      names.push_back(g.names.at(i));
    }
  const std::vector<int> owners = parameter_owners({all}, world);
  std::set<std::string> mine;
  for (size_t i = 0; i < names.size(); ++i)
    if (owners[i] == rank) mine.insert(names[i]);
  StateDict out;
  for (const auto& [key, t] : merged) {
    const size_t slash = key.rfind('/');
    const std::string owner = slash == std::string::npos ? key : key.substr(0, slash);
    if (owner == "@optimizer" || mine.count(owner)) out[key] = t;
  }
  return out;
}

void load_merged_optimizer_state(const std::vector<std::shared_ptr<Optimizer>>& optimizers,
                                 const StateDict& state) {
  std::map<std::string, bool> known;
  for (const auto& opt : optimizers)
    for (size_t g = 0; g < opt->num_groups(); ++g)
      for (const auto& n : opt->group(g).names) known[n] = true;
  for (const auto& kv : state) {
    const std::string& key = kv.first;
    if (key.rfind("@optimizer/", 0) == 0) continue;
    const std::string param = key.substr(0, key.rfind('/'));
    if (!known.count(param))
      throw Error("checkpoint holds optimizer state for parameter '" + param +
                  "', which this model does not have: resume with the same model");
  }
  // Each optimizer checks the dict before it changes; when a later one refuses it, the ones
  // already loaded get their own state back, so a failed load changes no optimizer. The last one
  // has no later one to fail after it: it needs no copy.
  std::vector<StateDict> before;
  size_t loaded = 0;
  try {
    for (; loaded < optimizers.size(); ++loaded) {
      if (loaded + 1 < optimizers.size()) before.push_back(optimizers[loaded]->state_dict());
      optimizers[loaded]->load_state_dict(state);
    }
  } catch (...) {
    for (size_t i = 0; i < loaded; ++i) optimizers[i]->load_state_dict(before[i]);
    throw;
  }
}

namespace {

// Copies `saved` into `live` (in place), refusing any difference of names, shapes or float width;
// `what` is "parameter" or "buffer".
void restore_named(const std::map<std::string, at::Tensor>& saved,
                   const std::vector<std::pair<std::string, at::Tensor>>& live,
                   const std::string& what) {
  if (saved.size() != live.size())
    throw Error("checkpoint has " + std::to_string(saved.size()) + " " + what +
                "s, this model has " + std::to_string(live.size()) +
                ": resume with the same model and options");
  at::NoGradGuard no_grad;
  for (const auto& [name, p] : live) {
    auto it = saved.find(name);
    if (it == saved.end())
      throw Error("checkpoint has no " + what + " '" + name + "': resume with the same model");
    if (it->second.sizes() != p.sizes())
      throw Error("checkpoint " + what + " '" + name + "' has shape " +
                  c10::str(it->second.sizes()) + ", this model's has " + c10::str(p.sizes()) +
                  ": resume with the same model options");
    // float32 <-> bf16/fp16 is a change of storage a resume may make (--full-bf16); float64 is a
    // different run, whose float64 optimizer state would meet float32 parameters.
    const at::ScalarType from = it->second.scalar_type(), to = p.scalar_type();
    if (from != to && (!c10::isFloatingType(from) || !c10::isFloatingType(to)))
      throw Error("checkpoint " + what + " '" + name + "' is " + c10::toString(from) +
                  ", this model's is " + c10::toString(to) +
                  ": an integer tensor and a floating one are not the same state (a checkpoint "
                  "of another version of the model?)");
    if (from != to && (from == at::kDouble || to == at::kDouble))
      throw Error("checkpoint " + what + " '" + name + "' is " + c10::toString(from) +
                  ", this model's is " + c10::toString(to) + ": resume with --dtype " +
                  (from == at::kDouble ? "float64" : "float32"));
    p.copy_(it->second);
  }
}

}  // namespace

void restore_parameters(const std::map<std::string, at::Tensor>& saved,
                        const std::vector<std::pair<std::string, at::Tensor>>& params) {
  restore_named(saved, params, "parameter");
}

void restore_buffers(const std::map<std::string, at::Tensor>& saved,
                     const std::vector<std::pair<std::string, at::Tensor>>& buffers) {
  restore_named(saved, buffers, "buffer");
}

std::map<std::string, at::Tensor> capture_rng_state() {
  std::map<std::string, at::Tensor> out;
  out["cpu"] = at::detail::getDefaultCPUGenerator().get_state();
  return out;
}

void restore_rng_state(const std::map<std::string, at::Tensor>& states) {
  auto it = states.find("cpu");
  if (it != states.end()) {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(it->second);
  }
}

void save_model_weights(const std::vector<std::pair<std::string, at::Tensor>>& params,
                        const fs::path& path) {
  // What torch::jit::pickle_save writes (a zip archive: the pickle of the dict, one record per
  // storage), streamed into the file instead of built in memory, so saving holds no copy of the
  // archive. Contiguous CPU tensors are pickled and written from their own memory. Any other
  // (on a GPU, or not contiguous) is pickled as a placeholder: a CPU tensor of its dtype and
  // sizes, contiguous, over a storage without memory (the pickle reads only their metadata, and
  // says "cpu", so that Python's torch.load needs no map_location); its record is then written
  // from the tensor brought to the CPU and made contiguous alone, so that saving a model on a GPU
  // holds one tensor's host copy at a time, not the whole model's.
  c10::Dict<std::string, at::Tensor> d;
  std::map<const void*, at::Tensor> placeholders;  // a placeholder's storage -> its tensor
  for (const auto& [k, v0] : params) {
    const at::Tensor v = v0.detach();
    if (v.device().is_cpu() && v.is_contiguous()) {
      d.insert(k, v);
      continue;
    }
    const uint64_t nbytes = static_cast<uint64_t>(v.numel()) * v.element_size();
    at::Storage empty(at::Storage::use_byte_size_t(), static_cast<int64_t>(nbytes),
                      at::DataPtr(nullptr, at::Device(at::kCPU)), nullptr, false);
    at::Tensor placeholder =  // contiguous: set_ without strides gives row-major ones
        at::empty({0}, at::TensorOptions().dtype(v.scalar_type())).set_(empty, 0, v.sizes());
    placeholders[placeholder.storage().unsafeGetStorageImpl()] = v;
    d.insert(k, placeholder);
  }
  std::vector<char> pickle;
  torch::jit::Pickler pickler(
      [&](const char* p, size_t n) { pickle.insert(pickle.end(), p, p + n); });
  pickler.protocol();
  pickler.pushIValue(c10::IValue(d));
  pickler.stop();
  detail::write_file_atomically_with(path, [&](int fd) -> const char* {
    const char* failed = nullptr;
    int error = 0;
    try {
      caffe2::serialize::PyTorchStreamWriter writer([&](const void* p, size_t n) -> size_t {
        if (!failed && (failed = detail::write_all(fd, static_cast<const char*>(p), n)))
          error = errno;
        return failed ? 0 : n;
      });
      const std::vector<at::Tensor>& storages = pickler.tensorData();
      for (size_t i = 0; i < storages.size(); ++i) {
        const std::string record = "data/" + std::to_string(i);
        const auto source = placeholders.find(storages[i].storage().unsafeGetStorageImpl());
        if (source == placeholders.end()) {
          const torch::jit::WriteableTensorData data =
              torch::jit::getWriteableTensorData(storages[i]);
          writer.writeRecord(record, data.data(), data.sizeInBytes());
          continue;
        }
        const at::Tensor host = source->second.to(at::kCPU).contiguous();
        writer.writeRecord(record, host.data_ptr(), host.numel() * host.element_size());
      }
      writer.writeRecord("data.pkl", pickle.data(), pickle.size());
      writer.writeEndOfFile();
    } catch (const c10::Error&) {
      if (!failed) throw;  // the writer's own fault, not the file's
    }
    errno = error;
    return failed;
  });
}

std::map<std::string, at::Tensor> load_model_weights(const fs::path& path, bool* mapped) {
  if (mapped) *mapped = false;
  // Mapped when it can be: a copy of the file, the pickle's copy of every storage and the tensors
  // made of them would need three times its size at once.
  if (fs::is_regular_file(path)) {
    try {
      if (auto tensors = detail::map_torch_archive(path)) {
        if (mapped) *mapped = true;
        return *std::move(tensors);
      }
    } catch (const std::exception& e) {
      throw Error("model weights " + path.string() + " cannot be decoded (" + first_line(e.what()) +
                  ")");
    }
  }
  const std::string bytes = read_all(path, "model weights");
  try {
    return tensor_map(torch::jit::pickle_load(std::vector<char>(bytes.begin(), bytes.end())));
  } catch (const std::exception& e) {
    throw Error("model weights " + path.string() + " cannot be decoded (" + first_line(e.what()) +
                ")");
  }
}

std::string read_file_head(const fs::path& path, size_t n) {
  std::string head(n, '\0');
  std::ifstream in(path, std::ios::binary);
  in.read(head.data(), static_cast<std::streamsize>(n));
  head.resize(static_cast<size_t>(std::max<std::streamsize>(in.gcount(), 0)));
  return head;
}

bool looks_like_checkpoint(const std::string& head) {
  return head.size() >= sizeof(kMagic) && std::memcmp(head.data(), kMagic, sizeof(kMagic)) == 0;
}

std::string checkpoint_name(int64_t step) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "checkpoint-%08lld.fbx", static_cast<long long>(step));
  return buf;
}

fs::path temporary_path(const fs::path& target) {
  const fs::path dir = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  return dir / ("." + target.filename().string() + ".tmp." + std::to_string(::getpid()));
}

std::optional<int64_t> checkpoint_step(const fs::path& file) {
  static const std::regex pattern(R"(checkpoint-(\d{1,18})\.fbx)");
  std::smatch m;
  const std::string name = file.filename().string();
  if (!std::regex_match(name, m, pattern)) return std::nullopt;
  return std::stoll(m[1]);  // at most 18 digits: always fits
}

bool is_output_file_name(const std::string& name) {
  static const std::set<std::string> others = {"latest-checkpoint", "metrics.jsonl", "metrics.csv",
                                               "summary.json", "comparison.txt"};
  return checkpoint_step(name).has_value() || others.count(name) > 0;
}

namespace {

// The checkpoints in `dir` with their steps, oldest first.
std::vector<std::pair<int64_t, fs::path>> checkpoints_by_step(const fs::path& dir) {
  std::vector<std::pair<int64_t, fs::path>> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (const auto step = checkpoint_step(e.path())) found.emplace_back(*step, e.path());
  std::sort(found.begin(), found.end());
  return found;
}

}  // namespace

std::vector<fs::path> list_checkpoints(const fs::path& dir) {
  std::vector<fs::path> out;
  for (auto& f : checkpoints_by_step(dir)) out.push_back(f.second);
  return out;
}

void remove_stale_temporaries(const fs::path& dir) {
  // Only temporaries of the files fusebox writes into an output folder (see temporary_path),
  // garbage once their writer is gone (killed mid-write); anything else there is the user's.
  static const std::regex temporary(R"(\.(.+)\.tmp\.(\d{1,9}))");
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::smatch m;
    const std::string name = e.path().filename().string();
    if (!std::regex_match(name, m, temporary) || !is_output_file_name(m[1])) continue;
    const long long pid = std::stoll(m[2]);  // at most 9 digits
    if (pid == ::getpid()) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM) continue;  // writer alive
    // No such process here; a writer in another PID namespace (a container sharing the folder)
    // still holds the file's lock.
    const int fd = ::open(e.path().c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) continue;
    const bool locked = ::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
    if (!locked) fs::remove(e.path(), ec);
    ::close(fd);
  }
}

namespace {
constexpr const char* kLatestPointer = "latest-checkpoint";
}  // namespace

void mark_latest_checkpoint(const fs::path& checkpoint) {
  write_file_atomically(checkpoint.parent_path() / kLatestPointer,
                        checkpoint.filename().string() + "\n");
}

std::optional<fs::path> latest_checkpoint(const fs::path& dir) {
  // The pointer travels with the folder (copies, syncs), unlike modification times.
  std::ifstream in(dir / kLatestPointer);
  std::string name;
  if (in && std::getline(in, name) && checkpoint_step(name) &&
      name.find('/') == std::string::npos) {
    std::error_code ec;
    if (fs::is_regular_file(dir / name, ec)) return dir / name;
  }
  const std::vector<fs::path> all = list_checkpoints(dir);  // no pointer: the highest step
  if (all.empty()) return std::nullopt;
  return all.back();
}

void prune_checkpoints(const fs::path& dir, int64_t keep, int64_t newest_step) {
  remove_stale_temporaries(dir);
  if (keep <= 0) return;
  // Checkpoints of later steps than this run's newest belong to another run: not ours to count.
  std::vector<fs::path> ours;
  for (const auto& [step, p] : checkpoints_by_step(dir))
    if (step <= newest_step) ours.push_back(p);
  for (size_t i = 0; i + static_cast<size_t>(keep) < ours.size(); ++i) {
    std::error_code ec;
    fs::remove(ours[i], ec);
  }
}

}  // namespace fusebox
