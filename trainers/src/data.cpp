#include "data.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <mutex>

#include "fusebox/error.h"
#include "tensor_data.h"

namespace fusebox::trainer {

uint64_t data_seed(int64_t seed) { return static_cast<uint64_t>(seed) * 2654435761u + 17; }

at::Generator data_generator(int64_t seed) {
  return at::detail::createCPUGenerator(data_seed(seed));
}

int64_t held_out(int64_t size, double fraction) {
  return static_cast<int64_t>(std::floor(static_cast<double>(size) * fraction));
}

std::string fraction_text(double f) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", f);
  return text;
}

void DataSource::restart(uint64_t seed) {
  at::Generator& gen = generator();
  const std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_current_seed(seed);
}

Batch DataSource::pass_batch(int64_t) {
  throw Error("the data stream " + describe() + " has no pass over its samples");
}

namespace {

const at::TensorOptions kFloat = at::TensorOptions().dtype(at::kFloat);
const at::TensorOptions kLong = at::TensorOptions().dtype(at::kLong);

class MlpData : public DataSource {
 public:
  MlpData(int64_t batch, int64_t width, int64_t seed) : batch_(batch), gen_(data_generator(seed)) {
    teacher_in_ = at::randn({width, width}, gen_, kFloat) / std::sqrt(static_cast<double>(width));
    teacher_out_ = at::randn({width, 1}, gen_, kFloat) / std::sqrt(static_cast<double>(width));
  }
  Batch next() override {
    Batch b;
    b.input = at::randn({batch_, teacher_in_.size(0)}, gen_, kFloat);
    b.target = at::tanh(b.input.matmul(teacher_in_)).matmul(teacher_out_) * 2.0;
    return b;
  }
  std::string describe() const override { return "synthetic regression (fixed random teacher)"; }

 private:
  int64_t batch_;
  at::Generator& generator() override { return gen_; }
  at::Generator gen_;
  at::Tensor teacher_in_, teacher_out_;
};

class SequenceData : public DataSource {
 public:
  SequenceData(int64_t batch, int64_t seq_len, int64_t vocab, int64_t seed)
      : batch_(batch), seq_len_(seq_len), vocab_(vocab), gen_(data_generator(seed)) {
    perm_ = at::randperm(vocab, gen_, kLong);
  }
  Batch next() override {
    at::Tensor seq = at::empty({batch_, seq_len_ + 1}, kLong);
    at::Tensor cur = at::randint(vocab_, {batch_}, gen_, kLong);
    for (int64_t i = 0; i <= seq_len_; ++i) {
      seq.select(1, i).copy_(cur);
      cur = perm_.index_select(0, cur);
    }
    Batch b;
    b.input = seq.slice(1, 0, seq_len_), b.target = seq.slice(1, 1, seq_len_ + 1);
    return b;
  }
  std::string describe() const override {
    return "synthetic token sequences (vocabulary " + std::to_string(vocab_) + ")";
  }

 private:
  int64_t batch_, seq_len_, vocab_;
  at::Generator& generator() override { return gen_; }
  at::Generator gen_;
  at::Tensor perm_;
};

class TextData : public DataSource {
 public:
  TextData(const std::string& path, int64_t batch, int64_t window, int64_t seed, bool split,
           DataPart part = {})
      : path_(path), batch_(batch), window_(window), split_(split), gen_(data_generator(seed)) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw Error("text file " + path + " cannot be read");
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (in.bad()) throw Error("text file " + path + " cannot be read");
    const int64_t size = static_cast<int64_t>(bytes.size());
    const int64_t held = held_out(size, part.holdout);
    const bool tail = part.held_out && part.holdout > 0;  // else the file, or its first part
    const int64_t begin = tail ? size - held : 0, end = tail ? size : size - held;
    // One window of bytes is enough: every sample is then that window. With a held-out part
    // both parts are checked, whichever this stream reads, so a run without --eval-every (whose
    // evaluation stream is never made) learns now that a resumed one could not evaluate.
    const std::string need =
        "; --seq-len " + std::to_string(window - 1) + " needs at least " + std::to_string(window);
    if (part.holdout == 0 && size < window)
      throw Error("text file " + path + " has " + std::to_string(size) + " bytes" + need);
    for (const bool evaluation : {false, true}) {
      const int64_t length = evaluation ? held : size - held;
      if (part.holdout == 0 || length >= window) continue;
      throw Error("text file " + path + " (" + std::to_string(size) + " bytes): --eval-holdout " +
                  fraction_text(part.holdout) + " leaves " + std::to_string(length) +
                  " bytes for " + (evaluation ? "evaluation" : "training") + need +
                  (evaluation ? " (hold out more, or give a longer file)"
                              : " (hold out less, or give a longer file)"));
    }
    // Kept as bytes (one per token, not eight): the file stays in memory for the whole run and
    // would otherwise weigh on every step's peak.
    tokens_ = at::empty({end - begin}, at::kByte);
    std::memcpy(tokens_.data_ptr<uint8_t>(), bytes.data() + begin, end - begin);
    if (part.holdout > 0)
      part_ = (part.held_out ? "the last " : "the first ") + std::to_string(end - begin) + " of " +
              std::to_string(size) + " bytes, " +
              (part.held_out ? "held out for evaluation" : std::to_string(held) + " held out");
  }
  Batch next() override {
    return batch_at(at::randint(tokens_.size(0) - window_ + 1, {batch_}, gen_, kLong));
  }
  // --eval-batches 0: the windows that start every window - 1 bytes, as a token stream's, so
  // that every byte after the first is predicted exactly once (the bytes after the last whole
  // window are left out); batch i holds windows [i * batch, (i + 1) * batch).
  int64_t pass_batches() const override { return (pass_windows() + batch_ - 1) / batch_; }
  Batch pass_batch(int64_t i) override {
    const int64_t first = i * batch_, n = std::min(batch_, pass_windows() - first);
    return batch_at(at::arange(first, first + n, kLong) * (window_ - 1));
  }
  int64_t pass_windows() const { return (tokens_.size(0) - 1) / (window_ - 1); }
  std::string describe() const override {
    return "text " + path_ + " (" +
           (part_.empty() ? std::to_string(tokens_.size(0)) + " bytes" : part_) + ")";
  }

 private:
  std::string path_;
  int64_t batch_, window_;
  bool split_;
  std::string part_;  ///< with a held-out part: which bytes these are
  at::Generator& generator() override { return gen_; }
  // The windows of bytes that start at `starts`.
  Batch batch_at(const at::Tensor& starts) const {
    const int64_t n = starts.size(0);
    at::Tensor idx = starts.unsqueeze(1) + at::arange(window_, kLong).unsqueeze(0);
    at::Tensor seq = tokens_.index_select(0, idx.reshape({-1})).reshape({n, window_}).to(kLong);
    Batch b;
    if (!split_) {
      b.input = seq;
    } else {
      b.input = seq.slice(1, 0, window_ - 1), b.target = seq.slice(1, 1, window_);
    }
    return b;
  }
  at::Generator gen_;
  at::Tensor tokens_;
};

class ImageData : public DataSource {
 public:
  ImageData(int64_t batch, int64_t size, int64_t seed)
      : batch_(batch), size_(size), gen_(data_generator(seed)) {}
  // Sums of three low-frequency plane waves per channel: smooth images a small UNet can learn.
  Batch next() override {
    const double two_pi = 2 * M_PI;
    at::Tensor coord = at::arange(size_, kFloat) / static_cast<double>(size_);
    at::Tensor ys = coord.view({1, 1, size_, 1}), xs = coord.view({1, 1, 1, size_});
    at::Tensor img = at::zeros({batch_, kImageChannels, size_, size_}, kFloat);
    for (int k = 0; k < 3; ++k) {
      at::Tensor fx = at::randint(0, 3, {batch_, 1, 1, 1}, gen_, kFloat);
      at::Tensor fy = at::randint(0, 3, {batch_, 1, 1, 1}, gen_, kFloat);
      at::Tensor phase = at::rand({batch_, kImageChannels, 1, 1}, gen_, kFloat) * two_pi;
      at::Tensor amp = at::rand({batch_, kImageChannels, 1, 1}, gen_, kFloat) * 0.4 + 0.2;
      img += amp * at::sin(two_pi * (fx * xs + fy * ys) + phase);
    }
    Batch b;
    b.input = img.clamp(-1, 1);
    b.noise = at::randn(img.sizes(), gen_, kFloat);
    b.timesteps = at::randint(kDiffusionSteps, {batch_}, gen_, kLong);
    return b;
  }
  std::string describe() const override {
    return "synthetic " + std::to_string(size_) + "x" + std::to_string(size_) +
           " images with diffusion noise";
  }

 private:
  int64_t batch_, size_;
  at::Generator& generator() override { return gen_; }
  at::Generator gen_;
};

class GaussianData : public DataSource {
 public:
  GaussianData(int64_t batch, int64_t width, int64_t seed)
      : batch_(batch), width_(width), gen_(data_generator(seed)) {}
  Batch next() override {
    Batch b;
    b.input = at::randn({batch_, width_}, gen_, kFloat);
    return b;
  }
  std::string describe() const override { return "synthetic N(0, 1) features"; }

 private:
  int64_t batch_, width_;
  at::Generator& generator() override { return gen_; }
  at::Generator gen_;
};

class NoData : public DataSource {
 public:
  Batch next() override {
    Batch b;
    b.input = at::empty({0}, kFloat);
    return b;
  }
  std::string describe() const override { return "none"; }
  at::Generator& generator() override { return gen_; }  // unused, but its state round-trips

 private:
  at::Generator gen_ = data_generator(0);
};

// The stream of `c`'s training data, or of its evaluation data (--eval-dataset, or the held-out
// end of the training text).
std::unique_ptr<DataSource> make_stream(const TrainConfig& c, bool evaluation,
                                        const std::vector<ForwardArgument>& forward) {
  const int64_t b = c.train_batch_size;
  const std::string& dataset = evaluation ? c.eval_dataset : c.dataset;
  const std::string& path = evaluation ? c.eval_dataset_path : c.dataset_path;
  const DataPart part{c.eval_holdout, evaluation};
  if (dataset == "none") return std::make_unique<NoData>();
  const std::string label = evaluation ? "--eval-dataset" : "--dataset";
  // A forward without arguments makes its own data: data given to it would go unused.
  if (c.model_script && forward.empty())
    throw Error(label + " " + dataset + (path.empty() ? "" : ":" + path) +
                " gives the model script's forward data, and it takes no argument (it makes its "
                "own data): give " +
                label + " none");
  if (dataset == "tensors") return make_tensor_data(c, label, path, part, forward);
  if (c.model_script) {
    // The other data give a script's forward one tensor: one that needs more is told now, not
    // at its first step.
    std::string required;
    int64_t count = 0;
    for (const ForwardArgument& a : forward)
      if (!a.has_default) required += (count++ ? ", " : "") + a.name;
    if (count > 1)
      throw Error(label + " " + dataset +
                  " gives the model script's forward one tensor, and it needs " +
                  std::to_string(count) + " (" + required + "): give " + label +
                  " tensors:PATH with tensors named after them");
    if (dataset == "text")
      return std::make_unique<TextData>(path, b, c.seq_len + 1, c.seed, false, part);
    return std::make_unique<GaussianData>(b, c.model_width, c.seed);
  }
  if (c.model == "transformer") {
    if (dataset == "text")
      return std::make_unique<TextData>(path, b, c.seq_len + 1, c.seed, true, part);
    return std::make_unique<SequenceData>(b, c.seq_len, c.vocab_size, c.seed);
  }
  if (c.model == "denoiser") return std::make_unique<ImageData>(b, c.image_size, c.seed);
  return std::make_unique<MlpData>(b, c.model_width, c.seed);
}

}  // namespace

EvalData::EvalData(const TrainConfig& c, const std::vector<ForwardArgument>& forward) {
  source_ = make_stream(c, true, forward);
  // Another stream from the same seed: a fixed odd offset (the golden ratio's bits) keeps it
  // apart from the training stream's for every seed.
  seed_ = data_seed(c.seed) + 0x9E3779B97F4A7C15ull;
  rewind();
}

void EvalData::rewind() { source_->restart(seed_); }

std::string EvalData::describe() const { return source_->describe(); }

std::unique_ptr<DataSource> make_data(const TrainConfig& c,
                                      const std::vector<ForwardArgument>& forward) {
  return make_stream(c, false, forward);
}

}  // namespace fusebox::trainer
