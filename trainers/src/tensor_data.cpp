#include "tensor_data.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <set>

#include "fusebox/core/checkpoint.h"
#include "fusebox/core/npy.h"
#include "fusebox/core/safetensors.h"
#include "fusebox/core/zip_archive.h"
#include "fusebox/error.h"
#include "tensor_file.h"

namespace fusebox::trainer {

namespace {

using Named = std::vector<std::pair<std::string, at::Tensor>>;

// How the model reads a batch's rows.
enum class Layout {
  kScriptInput,      // one tensor, forward's only argument
  kScriptArguments,  // forward's arguments by name
  kTokens,           // transformer: input and next tokens of one sequence
  kRegression,       // mlp: input and target
  kImages,           // denoiser: clean images; noise and timesteps drawn
};

// "[8] Float" for a tensor of [N, 8] floats: one sample's shape, and the type the model gets
// (`type`, when given: that of an unsigned tensor kept in its carrier).
std::string sample_text(const at::Tensor& t, at::ScalarType type = at::ScalarType::Undefined) {
  return c10::str(t.sizes().slice(1)) + " " +
         std::string(c10::toString(type == at::ScalarType::Undefined ? t.scalar_type() : type));
}

// What a --dataset tensors: file may be, for the errors that name what to give.
constexpr const char* kGive =
    "give a safetensors file, a .npy or .npz file (np.save, np.savez), a torch.save'd {name: "
    "tensor} dict of samples, or a headerless .bin file of token ids of --token-dtype";

// Every tensor in the file, by name; `mapped` tells whether they view the file mapped into memory
// (a file larger than memory trains, and local ranks share its pages) or were read into memory (a
// torch.save'd file whose records cannot be viewed). Unsigned uint16/uint32 tensors stay in their
// signed carriers, mapped, and `unsigned_types` names them (batches are widened as they are
// gathered). The one array of a .npy or headerless .bin file is named `array_name`, an .npz
// file's arrays by their names in it.
std::map<std::string, at::Tensor> read_tensors(const std::string& where, const std::string& path,
                                               const TrainConfig& c, const std::string& array_name,
                                               bool& mapped, UnsignedTypes& unsigned_types) {
  const std::string head = read_file_head(path, 512);  // an .npz's first entry name too
  if (looks_like_checkpoint(head))
    throw Error(where + " is a fusebox checkpoint, not data: " + kGive);
  unsigned_types.clear();
  // A file of one array, mapped by `map` (which says the type an unsigned one widens into).
  auto one_array = [&](const std::function<at::Tensor(at::ScalarType*)>& map) {
    mapped = true;
    at::ScalarType widens = at::ScalarType::Undefined;
    at::Tensor t = map(&widens);
    if (widens != at::ScalarType::Undefined) unsigned_types[array_name] = widens;
    return std::map<std::string, at::Tensor>{{array_name, std::move(t)}};
  };
  if (looks_like_npy(head)) return one_array([&](at::ScalarType* w) { return map_npy(path, w); });
  if (looks_like_npz(head)) {
    mapped = true;
    return map_npz(path, &unsigned_types);
  }
  // A headerless .bin file of token ids (numpy's tofile, nanoGPT's train.bin); a zip archive is a
  // torch.save'd file (pytorch_model.bin).
  if (std::filesystem::path(path).extension() == ".bin" && !looks_like_zip(head))
    return one_array([&](at::ScalarType* w) { return map_raw_array(path, c.token_dtype, w); });
  // torch.save writes a zip archive.
  if (!looks_like_safetensors(head) && !is_safetensors_path(path) && !looks_like_zip(head))
    throw Error(where + " is neither a safetensors, a NumPy nor a torch.save'd file: " + kGive);
  return read_tensor_file(path, head,
                          where +
                              " cannot be read: LibTorch's reader crashed on it (a malformed "
                              "file); write it again with torch.save or "
                              "safetensors.torch.save_file",
                          &mapped, &unsigned_types);
}

// read_tensors, its errors all starting with `where`.
std::map<std::string, at::Tensor> read_file(const std::string& where, const std::string& path,
                                            const TrainConfig& c, const std::string& array_name,
                                            bool& mapped, UnsignedTypes& unsigned_types) {
  try {
    return read_tensors(where, path, c, array_name, mapped, unsigned_types);
  } catch (const Error& e) {
    const std::string what = e.what();
    if (what.rfind(where, 0) == 0) throw;
    throw Error(where + ": " + what + "; " + kGive);
  }
}

// The transformer reads a one-dimensional tensor of token ids as one stream (a tokenized corpus):
// its samples are windows of --seq-len + 1 ids that start every --seq-len ids, so each id is
// predicted once, and the ids after the last whole window are left out. The windows are a view of
// the ids (no copy; a mapped file stays mapped). Returns the stream's ids, 0 for other data.
int64_t stream_to_windows(const std::string& where, const TrainConfig& c,
                          std::map<std::string, at::Tensor>& all) {
  if (c.model_script || c.model != "transformer" || all.size() != 1) return 0;
  auto& [name, t] = *all.begin();
  if (t.dim() != 1 || t.is_floating_point() || t.is_complex() || t.scalar_type() == at::kBool)
    return 0;
  const int64_t ids = t.size(0), window = c.seq_len + 1;
  if (ids < window)
    throw Error(where + ": '" + name + "' is a stream of " + std::to_string(ids) +
                " token ids; --seq-len " + std::to_string(c.seq_len) + " needs at least " +
                std::to_string(window) +
                (ids >= 2 ? " (give --seq-len " + std::to_string(ids - 1) + ")" : ""));
  const int64_t windows = (ids - 1) / c.seq_len;
  t = t.as_strided({windows, window}, {c.seq_len * t.stride(0), t.stride(0)}, t.storage_offset());
  return ids;
}

// The number of samples: tensors, each with a first dimension, all with the same number of rows.
int64_t count_samples(const std::string& where, const std::map<std::string, at::Tensor>& all) {
  if (all.empty()) throw Error(where + " holds no tensors");
  const auto& [first_name, first] = *all.begin();
  for (const auto& [name, t] : all) {
    const std::string what = where + ": '" + name + "'";
    if (t.dim() == 0)
      throw Error(what + " is a scalar: every tensor's first dimension counts the samples");
    if (t.size(0) != first.size(0))
      throw Error(what + " has " + std::to_string(t.size(0)) + " samples (its first dimension), '" +
                  first_name + "' has " + std::to_string(first.size(0)) +
                  ": every tensor holds one row per sample");
  }
  if (first.size(0) == 0) throw Error(where + " holds no samples (its tensors have 0 rows)");
  return first.size(0);
}

// The checks every tensors file gets: count_samples's, nothing complex, and with `values` every
// value finite. Returns the number of samples.
int64_t check_samples(const std::string& where, const std::map<std::string, at::Tensor>& all,
                      bool values = true) {
  const int64_t samples = count_samples(where, all);
  for (const auto& [name, t] : all) {
    const std::string what = where + ": '" + name + "'";
    if (t.is_complex())
      throw Error(what + " is " + c10::toString(t.scalar_type()) +
                  ": the trainer reads real numbers and integers");
    if (values && t.is_floating_point() && !all_finite(t))
      throw Error(what +
                  " holds values that are not finite (NaN or Inf): a NaN sample makes the "
                  "loss NaN; clean or drop those samples");
  }
  return samples;
}

// "forward(x, y, mask=...)"
std::string signature(const std::vector<ForwardArgument>& forward) {
  std::string s = "forward(";
  for (size_t i = 0; i < forward.size(); ++i)
    s += (i ? ", " : "") + forward[i].name + (forward[i].has_default ? "=..." : "");
  return s + ")";
}

// Which tensors a script model's forward takes, and how.
Layout script_layout(const std::string& where, const std::map<std::string, at::Tensor>& all,
                     const std::vector<ForwardArgument>& forward) {
  const size_t required = static_cast<size_t>(std::count_if(
      forward.begin(), forward.end(), [](const ForwardArgument& a) { return !a.has_default; }));
  std::set<std::string> names;
  for (const ForwardArgument& a : forward) names.insert(a.name);
  // One tensor for a forward with one argument to fill (its first): its name does not matter,
  // unless it names another argument.
  if (all.size() == 1 &&
      (forward.size() == 1 || (required == 1 && !names.count(all.begin()->first))))
    return Layout::kScriptInput;
  for (const auto& [name, t] : all)
    if (!names.count(name))
      throw Error(where + " holds '" + name + "', which the model script's " + signature(forward) +
                  " has no argument of: name the file's tensors after forward's arguments");
  for (const ForwardArgument& a : forward)
    if (!a.has_default && !all.count(a.name))
      throw Error(where + " has no '" + a.name + "' for the model script's " + signature(forward) +
                  ": name the file's tensors after forward's arguments");
  return Layout::kScriptArguments;
}

// The one tensor of a model that reads one, or an error saying what it reads.
const std::pair<const std::string, at::Tensor>& only_tensor(
    const std::string& where, const std::map<std::string, at::Tensor>& all,
    const std::string& reads) {
  if (all.size() != 1) {
    std::string names;
    for (const auto& [name, t] : all) names += (names.empty() ? "'" : ", '") + name + "'";
    throw Error(where + " holds " + std::to_string(all.size()) + " tensors (" + names + "); " +
                reads);
  }
  return *all.begin();
}

// The transformer's token ids: [N, seq_len + 1] integers below the vocabulary size.
void check_tokens(const std::string& where, const TrainConfig& c,
                  const std::map<std::string, at::Tensor>& all, const UnsignedTypes& unsigned_types,
                  bool values = true) {
  const std::string reads = "the transformer reads one tensor of token ids [samples, " +
                            std::to_string(c.seq_len + 1) +
                            "] (--seq-len + 1: input and next "
                            "tokens)";
  const auto& [name, t] = only_tensor(where, all, reads);
  const std::string what = where + ": '" + name + "'";
  if (t.is_floating_point() || t.scalar_type() == at::kBool)
    throw Error(what + " is " + c10::toString(t.scalar_type()) + "; " + reads);
  if (t.dim() != 2 || t.size(1) != c.seq_len + 1)
    throw Error(what + " has shape " + c10::str(t.sizes()) + "; " + reads +
                (t.dim() == 2 && t.size(1) >= 2
                     ? " (give --seq-len " + std::to_string(t.size(1) - 1) + ")"
                     : ""));
  if (!values) return;
  int64_t low = 0, high = 0;
  const auto widens = unsigned_types.find(name);
  in_pieces(t, [&](const at::Tensor& piece) {
    const at::Tensor ids =
        widens == unsigned_types.end() ? piece : widen_unsigned(piece, widens->second);
    low = std::min(low, ids.min().item<int64_t>());
    high = std::max(high, ids.max().item<int64_t>());
  });
  if (low < 0 || high >= c.vocab_size)
    throw Error(what + " holds token id " + std::to_string(low < 0 ? low : high) +
                ", outside --vocab-size " + std::to_string(c.vocab_size) + " (ids 0 to " +
                std::to_string(c.vocab_size - 1) + ")");
}

// The mlp's 'input' [N, width] and 'target' [N, 1] or [N], both floating.
void check_regression(const std::string& where, const TrainConfig& c,
                      const std::map<std::string, at::Tensor>& all) {
  const std::string reads = "the mlp reads 'input' [samples, " + std::to_string(c.model_width) +
                            "] (--model-width) and 'target' [samples, 1], both floating-point";
  for (const auto& [name, t] : all)
    if (name != "input" && name != "target") throw Error(where + " holds '" + name + "'; " + reads);
  for (const char* name : {"input", "target"}) {
    auto it = all.find(name);
    if (it == all.end()) throw Error(where + " has no '" + name + "'; " + reads);
    const at::Tensor& t = it->second;
    const bool input = std::string(name) == "input";
    const bool shaped = input ? t.dim() == 2 && t.size(1) == c.model_width
                              : t.dim() == 1 || (t.dim() == 2 && t.size(1) == 1);
    if (!t.is_floating_point() || !shaped)
      throw Error(where + ": '" + name + "' is " + c10::str(t.sizes()) + " " +
                  c10::toString(t.scalar_type()) + "; " + reads +
                  (input && t.dim() == 2 && t.is_floating_point()
                       ? " (give --model-width " + std::to_string(t.size(1)) + ")"
                       : ""));
  }
}

// The denoiser's images: [N, 3, S, S], floating (in [-1, 1]) or 8-bit (0 to 255).
void check_images(const std::string& where, const TrainConfig& c,
                  const std::map<std::string, at::Tensor>& all) {
  const std::string s = std::to_string(c.image_size);
  const std::string reads =
      "the denoiser reads one tensor of images [samples, " + std::to_string(kImageChannels) + ", " +
      s + ", " + s + "] (--image-size " + s + "): floating-point in [-1, 1], or uint8 pixels";
  const auto& [name, t] = only_tensor(where, all, reads);
  const bool square = t.dim() == 4 && t.size(1) == kImageChannels && t.size(2) == t.size(3);
  const bool pixels = t.is_floating_point() || t.scalar_type() == at::kByte;
  if (!pixels || !square || t.size(2) != c.image_size)
    throw Error(where + ": '" + name + "' is " + c10::str(t.sizes()) + " " +
                c10::toString(t.scalar_type()) + "; " + reads +
                (square && pixels ? " (give --image-size " + std::to_string(t.size(2)) + ")" : ""));
}

// splitmix64's finaliser: spreads the bits of a seed and an epoch over all of the 32 bits a CPU
// generator keeps of its seed.
uint64_t mix(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A tensor the model reads, in pieces: one per file of a folder (one for a file), each a view of
// its file's rows where it can be; the samples are the pieces' rows one after the other.
struct Column {
  std::string name;
  std::vector<at::Tensor> pieces;
  /// An unsigned tensor kept in its signed carrier: the type its gathered rows are widened into.
  at::ScalarType widens = at::ScalarType::Undefined;
};

class TensorData : public DataSource {
 public:
  TensorData(std::string text, Layout layout, std::vector<Column> columns, int64_t batch,
             uint64_t seed)
      : text_(std::move(text)),
        layout_(layout),
        columns_(std::move(columns)),
        batch_(batch),
        gen_(at::detail::createCPUGenerator(seed)),
        seed_(seed) {
    std::vector<int64_t> starts = {0};
    for (const at::Tensor& piece : columns_.front().pieces)
      starts.push_back(starts.back() + piece.size(0));
    samples_ = starts.back();
    starts_ = at::tensor(starts, at::TensorOptions().dtype(at::kLong));
  }

  Batch next() override { return batch_of(take(batch_), gen_); }

  int64_t pass_batches() const override { return (samples_ + batch_ - 1) / batch_; }
  Batch pass_batch(int64_t i) override {
    const int64_t first = i * batch_, n = std::min(batch_, samples_ - first);
    at::Generator g = at::detail::createCPUGenerator(
        mix(seed_ ^ (static_cast<uint64_t>(i) + 1) * 0xD1B54A32D192ED03ull));
    return batch_of(at::arange(first, first + n, at::TensorOptions().dtype(at::kLong)), g);
  }

  std::string describe() const override { return text_; }
  at::Generator& generator() override { return gen_; }
  int64_t samples_drawn() const override { return drawn_; }
  void set_samples_drawn(int64_t n) override { drawn_ = n, order_epoch_ = -1; }
  void restart(uint64_t seed) override {
    DataSource::restart(seed);
    seed_ = seed, drawn_ = 0, order_epoch_ = -1;
  }

 private:
  // The batch of the samples `rows`; `gen` draws the denoiser's noise and timesteps.
  Batch batch_of(const at::Tensor& rows, at::Generator& gen) const {
    const int64_t n = rows.size(0);
    Named picked;
    for (const Column& column : columns_) {
      at::Tensor t = gather(column, rows);
      if (column.widens != at::ScalarType::Undefined) t = widen_unsigned(t, column.widens);
      picked.emplace_back(column.name, std::move(t));
    }
    Batch b;
    switch (layout_) {
      case Layout::kScriptInput:
        b.input = picked[0].second;
        break;
      case Layout::kScriptArguments:
        b.arguments = std::move(picked);
        break;
      case Layout::kTokens: {
        const at::Tensor seq = picked[0].second.to(at::kLong);  // the file's ids may be narrower
        const int64_t window = seq.size(1);
        b.input = seq.slice(1, 0, window - 1);
        b.target = seq.slice(1, 1, window);
        break;
      }
      case Layout::kRegression:  // columns_: input, then target
        b.input = picked[0].second;
        b.target = picked[1].second.reshape({n, 1});
        break;
      case Layout::kImages:
        b.input = picked[0].second;
        if (b.input.scalar_type() == at::kByte)  // 8-bit pixels: 0 to 255 onto [-1, 1]
          b.input = b.input.to(at::kFloat) / 127.5 - 1.0;
        b.noise = at::randn(b.input.sizes(), gen, at::TensorOptions().dtype(at::kFloat));
        b.timesteps = at::randint(kDiffusionSteps, {n}, gen, at::kLong);
        break;
    }
    return b;
  }

  // The rows `rows` (sample numbers) of `column`, in that order, from whichever pieces hold them.
  at::Tensor gather(const Column& column, const at::Tensor& rows) const {
    if (column.pieces.size() == 1) return column.pieces[0].index_select(0, rows);
    const at::Tensor piece_of = at::searchsorted(starts_, rows, false, /*right=*/true) - 1;
    std::vector<int64_t> sizes = column.pieces[0].sizes().vec();
    sizes[0] = rows.size(0);
    at::Tensor out = at::empty(sizes, column.pieces[0].options());
    for (size_t p = 0; p < column.pieces.size(); ++p) {
      const at::Tensor here = (piece_of == static_cast<int64_t>(p)).nonzero().squeeze(1);
      if (here.numel() == 0) continue;
      const at::Tensor local = rows.index_select(0, here) - starts_[static_cast<int64_t>(p)];
      out.index_copy_(0, here, column.pieces[p].index_select(0, local));
    }
    return out;
  }

  // The next `n` sample indices: the rest of this epoch's order, then the next epoch's.
  at::Tensor take(int64_t n) {
    at::Tensor idx = at::empty({n}, at::kLong);
    for (int64_t filled = 0; filled < n;) {
      const int64_t epoch = drawn_ / samples_, offset = drawn_ % samples_;
      const int64_t k = std::min(n - filled, samples_ - offset);
      idx.narrow(0, filled, k).copy_(order(epoch).narrow(0, offset, k));
      filled += k, drawn_ += k;
    }
    return idx;
  }

  // Epoch `epoch`'s order of the samples, made from the seed and the epoch alone (not from the
  // stream's generator), so that a resumed stream needs only the count of samples drawn.
  const at::Tensor& order(int64_t epoch) {
    if (epoch != order_epoch_) {
      at::Generator g = at::detail::createCPUGenerator(
          mix(seed_ + static_cast<uint64_t>(epoch) * 0x9E3779B97F4A7C15ull));
      order_ = at::randperm(samples_, g, at::TensorOptions().dtype(at::kLong));
      order_epoch_ = epoch;
    }
    return order_;
  }

  std::string text_;
  Layout layout_;
  std::vector<Column> columns_;  ///< the tensors the model reads, in the order it reads them
  at::Tensor starts_;            ///< each piece's first sample, then the number of samples
  int64_t samples_ = 0, batch_;
  at::Generator gen_;  ///< the denoiser's noise and timesteps
  uint64_t seed_;
  int64_t drawn_ = 0;
  at::Tensor order_;
  int64_t order_epoch_ = -1;
};

}  // namespace

std::vector<std::string> data_files(const std::string& where, const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_directory(path, ec)) return {path};
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(path, ec)) {
    const std::string ext = entry.path().extension().string();
    std::error_code unused;  // a dangling link is no data file, not a folder that cannot be listed
    if (entry.is_regular_file(unused) && (ext == ".safetensors" || ext == ".npy" || ext == ".npz" ||
                                          ext == ".pt" || ext == ".pth" || ext == ".bin"))
      files.push_back(entry.path().string());
  }
  if (ec) throw Error(where + ": the folder cannot be listed (" + ec.message() + ")");
  if (files.empty())
    throw Error(
        where +
        " is a folder with no data files (.safetensors, .npy, .npz, .pt, .pth or .bin): give a "
        "file, or a folder of the files of one dataset");
  std::sort(files.begin(), files.end());
  return files;
}

ArchiveCheck check_archive_crcs(const TrainConfig& c) {
  ArchiveCheck out;
  std::set<std::string> done;  // a file both options name is read once
  auto check = [&](const std::string& label, const std::string& kind, const std::string& path) {
    if (kind != "tensors") return;
    const std::string where = label + " tensors:" + path;
    for (const std::string& file : data_files(where, path)) {
      if (!done.insert(file).second || !looks_like_zip(read_file_head(file, 4))) continue;
      if (!zlib_available()) {
        ++out.unchecked_archives;
        continue;
      }
      try {
        out.entries += check_zip_crcs(file);
      } catch (const Error& e) {
        // Its errors start with the file, which `where` names already unless it is a folder.
        std::string what = e.what();
        if (file == path && what.rfind(file + ": ", 0) == 0) what.erase(0, file.size() + 2);
        throw Error(where + ": " + what + "; copy or write the file again");
      }
    }
  };
  check("--dataset", c.dataset, c.dataset_path);
  check("--eval-dataset", c.eval_dataset, c.eval_dataset_path);
  return out;
}

namespace {

// One file of the data: its tensors (checked), whether they are mapped, and their samples.
struct Shard {
  std::string where;  ///< the option and the file, for errors
  std::map<std::string, at::Tensor> all;
  UnsignedTypes unsigned_types;  ///< unsigned tensors of `all`, kept in their carriers
  bool mapped = false;
  int64_t ids = 0;  ///< the transformer's token stream: its ids (0: rows of samples)
  int64_t samples = 0;
  std::string key;     ///< its checked_key
  bool values = true;  ///< its values are still to be checked (not done yet in this process)
};

// The key under which a file whose every value this process has checked is remembered: its path,
// device and inode, size, change and modification times, the vocabulary and --token-dtype ("" when
// it cannot be stat'ed: such a file is checked every time). The training and the evaluation stream
// of one file (or the runs of one config) then read a large file's values once, not once each; a
// file written anew since (a new inode when replaced, new times when written in place) is checked
// again.
std::string checked_key(const std::string& file, const TrainConfig& c) {
  struct stat st {};
  if (::stat(file.c_str(), &st) != 0) return "";
  std::string k = file;
  for (const int64_t v : {int64_t(st.st_dev), int64_t(st.st_ino), int64_t(st.st_size),
                          int64_t(st.st_mtim.tv_sec), int64_t(st.st_mtim.tv_nsec),
                          int64_t(st.st_ctim.tv_sec), int64_t(st.st_ctim.tv_nsec), c.vocab_size})
    k += "|" + std::to_string(v);
  return k + "|" + c.token_dtype;
}

// The checked_keys of the files that passed every check (the trainer makes its data on one
// thread).
std::set<std::string>& checked_files() {
  static std::set<std::string> keys;
  return keys;
}

// The folder `path` is when it is one (its `files` are not just `path`), else "".
std::string folder_of(const std::string& path, const std::vector<std::string>& files) {
  return files.size() == 1 && files.front() == path ? "" : path;
}

// The name of the one array of a .npy or headerless .bin file: the file's, or for the files of a
// folder the folder's, so that its files hold the same tensor (part-0.npy, part-1.npy, ...).
std::string array_name(const std::string& file, const std::string& folder) {
  if (folder.empty()) return std::filesystem::path(file).stem().string();
  std::filesystem::path p = std::filesystem::path(folder).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();  // "shards/"
  const std::string name = p.filename().string();
  return name.empty() || name == "." || name == ".." ? "data" : name;
}

// A file's tensors, a token stream cut into its windows, and its samples counted: what both the
// epochs' planning and the data stream read of a file.
Shard open_shard(const std::string& label, const TrainConfig& c, const std::string& file,
                 const std::string& folder) {
  Shard s;
  s.where = label + " tensors:" + file;
  s.all = read_file(s.where, file, c, array_name(file, folder), s.mapped, s.unsigned_types);
  s.ids = stream_to_windows(s.where, c, s.all);
  s.samples = count_samples(s.where, s.all);
  return s;
}

// open_shard, with the checks of every value (unless done already in this process).
Shard read_shard(const std::string& label, const TrainConfig& c, const std::string& file,
                 const std::string& folder) {
  const std::string key = checked_key(file, c);
  const bool values = key.empty() || checked_files().count(key) == 0;
  Shard s = open_shard(label, c, file, folder);
  s.key = key, s.values = values;
  check_samples(s.where, s.all, values);
  return s;
}

// "'x', 'y'"
std::string names_of(const std::map<std::string, at::Tensor>& all) {
  std::string out;
  for (const auto& [name, t] : all) out += (out.empty() ? "'" : ", '") + name + "'";
  return out;
}

// The tensors of `s` with the unsigned ones widened (the models that refuse them name their type).
const std::map<std::string, at::Tensor>& widened(Shard& s) {
  for (const auto& [name, type] : s.unsigned_types) s.all[name] = widen_unsigned(s.all[name], type);
  s.unsigned_types.clear();
  return s.all;
}

// The type the model gets of tensor `name` of `s`: an unsigned one's widened type, else its own.
at::ScalarType type_read(const Shard& s, const std::string& name) {
  auto it = s.unsigned_types.find(name);
  return it == s.unsigned_types.end() ? s.all.at(name).scalar_type() : it->second;
}

// The files of a folder hold the same tensors, each of the same kind of sample.
void check_like_first(const Shard& first, const Shard& s) {
  if (names_of(s.all) != names_of(first.all))
    throw Error(s.where + " holds " + names_of(s.all) + ", and " + first.where + " holds " +
                names_of(first.all) + ": every file of a folder holds the same tensors");
  for (const auto& [name, t] : s.all) {
    const at::Tensor& t0 = first.all.at(name);
    const at::ScalarType type = type_read(s, name), type0 = type_read(first, name);
    if (t.scalar_type() != t0.scalar_type() || type != type0 ||
        t.sizes().slice(1) != t0.sizes().slice(1))
      throw Error(s.where + ": '" + name + "' holds samples " + sample_text(t, type) + ", and in " +
                  first.where + " " + sample_text(t0, type0) +
                  ": every file of a folder holds samples of one shape and type");
  }
}

}  // namespace

std::unique_ptr<DataSource> make_tensor_data(const TrainConfig& c, const std::string& label,
                                             const std::string& path, DataPart part,
                                             const std::vector<ForwardArgument>& forward) {
  const std::string where = label + " tensors:" + path;
  const std::vector<std::string> files = data_files(where, path);
  std::vector<Shard> shards;
  Layout layout = Layout::kScriptInput;
  int64_t size = 0, ids = 0;
  for (const std::string& file : files) {
    Shard s = read_shard(label, c, file, folder_of(path, files));
    if (c.model_script)
      layout = script_layout(s.where, s.all, forward);
    else if (c.model == "transformer")
      check_tokens(s.where, c, s.all, s.unsigned_types, s.values), layout = Layout::kTokens;
    else if (c.model == "denoiser")
      check_images(s.where, c, widened(s)), layout = Layout::kImages;
    else
      check_regression(s.where, c, widened(s)), layout = Layout::kRegression;
    if (!shards.empty()) check_like_first(shards.front(), s);
    if (!s.key.empty()) checked_files().insert(s.key);
    size += s.samples, ids += s.ids;
    shards.push_back(std::move(s));
  }

  // --eval-holdout: the last samples (of the last files) are the evaluation's, the rest the
  // training's. Both parts are checked, whichever this stream reads, so that a run without
  // --eval-every learns now that a resumed one could not evaluate.
  const int64_t held = held_out(size, part.holdout);
  for (const bool evaluation : {false, true}) {
    const int64_t length = evaluation ? held : size - held;
    if (part.holdout == 0 || length >= 1) continue;
    throw Error(where + " (" + std::to_string(size) + " samples): --eval-holdout " +
                fraction_text(part.holdout) + " leaves no sample for " +
                (evaluation ? "evaluation (hold out more, or give more samples)"
                            : "training (hold out less, or give more samples)"));
  }
  const bool tail = part.held_out && part.holdout > 0;
  const int64_t begin = tail ? size - held : 0, end = tail ? size : size - held;

  // The columns in the order the layout reads them, each file's rows of [begin, end) a piece. The
  // evaluation's part of a file read into memory is copied out, so that the rest is not kept for
  // it (a mapped file's pages are shared).
  std::vector<Column> columns;
  auto add = [&](const std::string& name) {
    Column column{name, {}};
    if (auto it = shards.front().unsigned_types.find(name);
        it != shards.front().unsigned_types.end())
      column.widens = it->second;
    int64_t first = 0;  // the shard's first sample
    for (const Shard& s : shards) {
      const int64_t lo = std::max(begin, first), hi = std::min(end, first + s.samples);
      if (lo < hi) {
        at::Tensor t = s.all.at(name).narrow(0, lo - first, hi - lo);
        if (tail && !s.mapped) t = t.clone();
        column.pieces.push_back(t);
      }
      first += s.samples;
    }
    columns.push_back(std::move(column));
  };
  const std::map<std::string, at::Tensor>& all = shards.front().all;
  if (layout == Layout::kScriptArguments) {
    for (const ForwardArgument& a : forward)
      if (all.count(a.name)) add(a.name);
  } else if (layout == Layout::kRegression) {
    add("input"), add("target");
  } else {
    add(all.begin()->first);
  }
  shards.clear();

  std::string text = "tensors " + path + " (";
  if (files.size() != 1 || files.front() != path)
    text += std::to_string(files.size()) + (files.size() == 1 ? " file, " : " files, ");
  text += part.holdout > 0
              ? std::string(tail ? "the last " : "the first ") + std::to_string(end - begin) +
                    " of " + std::to_string(size) + " samples, " +
                    (tail ? "held out for evaluation" : std::to_string(held) + " held out")
              : std::to_string(size) + " samples";
  text += ": ";
  for (size_t i = 0; i < columns.size(); ++i)
    text += (i ? ", " : "") + columns[i].name + " " +
            sample_text(columns[i].pieces.front(), columns[i].widens);
  if (ids > 0)
    text +=
        std::string(files.size() == 1 ? ", windows of a stream of " : ", windows of streams of ") +
        std::to_string(ids) + " ids";
  text += "; shuffled each epoch)";
  return std::make_unique<TensorData>(std::move(text), layout, std::move(columns),
                                      c.train_batch_size, data_seed(c.seed));
}

void set_steps_from_epochs(TrainConfig& c) {
  if (c.max_train_epochs <= 0 && c.save_every_n_epochs <= 0 && c.eval_every_n_epochs <= 0) return;
  const std::string where = "--dataset tensors:" + c.dataset_path;
  int64_t samples = 0;
  const std::vector<std::string> files = data_files(where, c.dataset_path);
  for (const std::string& file : files)
    samples += open_shard("--dataset", c, file, folder_of(c.dataset_path, files)).samples;
  c.epoch_samples = samples - held_out(samples, c.eval_holdout);
  const int64_t per_step = c.train_batch_size * c.gradient_accumulation_steps;
  if (c.epoch_samples <= 0)
    throw Error(where + " (" + std::to_string(samples) + " samples): --eval-holdout " +
                fraction_text(c.eval_holdout) + " leaves no sample to train on");
  if (c.max_train_epochs <= 0) return;  // --save-every-n-epochs or --eval-every-n-epochs only
  if (c.max_train_epochs > (int64_t{1} << 62) / c.epoch_samples)
    throw Error("--max-train-epochs: " + std::to_string(c.max_train_epochs) + " epochs of " +
                std::to_string(c.epoch_samples) + " samples are more steps than a run can take");
  c.max_train_steps = (c.max_train_epochs * c.epoch_samples + per_step - 1) / per_step;
}

}  // namespace fusebox::trainer
