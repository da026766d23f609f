// AdamW with 8-bit moments: block-wise dynamic quantization after Dettmers et al. (2022), "8-bit
// Optimizers via Block-wise Quantization" (bitsandbytes' AdamW8bit). Each moment takes one byte
// per element instead of four, so AdamW's state shrinks to about a quarter of its float32 size.
//
// A moment is cut into blocks of block_size elements; a block keeps its scale in float32 (the
// largest |m|, the largest v) and each element the index of the nearest of 256 values of a
// dynamic map: a decimal exponent and a linear fraction, so the codes cover seven orders of
// magnitude below the block's scale instead of the two that linear int8 would. The step itself is
// AdamW's (the SDK's adam_step_), in float32, from the dequantized moments; only their storage is
// 8-bit. Tensors smaller than min_8bit_size keep float32 moments: biases and norms weigh nothing
// and are the most sensitive to rounding.
#include <ATen/Parallel.h>
#include <fusebox/sdk.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace {

// The dynamic map: 256 values, ascending, in [-1, 1] (signed, first moment) or [0, 1] (unsigned,
// second moment): for each decimal exponent e = -6..0, equal steps of the fraction [0.1, 1] (1,
// 2, 4, ... 64 of them signed, twice as many unsigned), then 0 and 1. A code is the index of the
// nearest value: the number of the 255 midpoints below x, as at::bucketize over the midpoints
// finds it on any device. A binary search per element mispredicts most of its branches, so the
// CPU loop starts from a table: floats ordered by their bits (sign flipped, negatives reversed)
// are cut into 2^17 buckets of relative width 2^-8, less than the gap between two midpoints, and
// the table holds the code of each bucket's smallest float; at most one midpoint more lies below
// x. Both maps are made once per process (dynamic_map()).
class DynamicMap {
 public:
  explicit DynamicMap(bool is_signed) : values_{0.0f, 1.0f}, table_(1 << 17) {
    for (int e = 0; e < 7; ++e) {
      const int steps = is_signed ? 1 << e : 2 << e;
      for (int k = 0; k < steps; ++k) {
        const double fraction = 0.1 + 0.9 * (k + 0.5) / steps;
        const float v = static_cast<float>(fraction * std::pow(10.0, e - 6));
        values_.push_back(v);
        if (is_signed) values_.push_back(-v);
      }
    }
    std::sort(values_.begin(), values_.end());
    for (size_t i = 0; i + 1 < values_.size(); ++i)
      midpoints_.push_back((values_[i] + values_[i + 1]) / 2);
    zero_ = std::find(values_.begin(), values_.end(), 0.0f) - values_.begin();
    for (uint32_t b = 0; b < table_.size(); ++b)
      table_[b] = static_cast<uint8_t>(
          std::lower_bound(midpoints_.begin(), midpoints_.end(), float_of_key(b << 15)) -
          midpoints_.begin());
  }
  const std::vector<float>& values() const { return values_; }
  const std::vector<float>& midpoints() const { return midpoints_; }
  /// The index of 0 among the values.
  int64_t zero() const { return zero_; }
  /// The code of `x` (already divided by its block's scale).
  uint8_t encode(float x) const {
    uint32_t c = table_[key_of(x) >> 15];
    while (c < midpoints_.size() && midpoints_[c] < x) ++c;
    return static_cast<uint8_t>(c);
  }

 private:
  // A key that orders floats as their values: the sign bit flipped, negative floats' bits
  // inverted (larger magnitude, smaller key).
  static uint32_t key_of(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
  }
  static float float_of_key(uint32_t key) {
    const uint32_t bits = key & 0x80000000u ? key & 0x7fffffffu : ~key;
    float x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
  }
  std::vector<float> values_, midpoints_;
  int64_t zero_ = 0;
  std::vector<uint8_t> table_;
};

const DynamicMap& dynamic_map(bool is_signed) {
  static const DynamicMap signed_map(true), unsigned_map(false);
  return is_signed ? signed_map : unsigned_map;
}

// A map's values and midpoints on one device, for the ATen path.
struct Codebook {
  at::Tensor values, midpoints;
};

// The CPU path for float32 parameters: one pass over each block that decodes both moments,
// applies AdamW's update (adam_step_'s arithmetic, element by element) and encodes them again,
// where the ATen path makes a dozen passes over the whole tensor. `first`: no moments yet (zeros).
struct CpuStep {
  const DynamicMap &signed_map, &unsigned_map;
  double b1, b2, eps, step_size, bc2_sqrt, decay;  // decay: 1 - lr·wd

  void operator()(float* p, const float* g, uint8_t* m_codes, float* m_scale, uint8_t* v_codes,
                  float* v_scale, int64_t n, int64_t block, bool first) const {
    const int64_t blocks = (n + block - 1) / block;
    at::parallel_for(0, blocks, std::max<int64_t>(1, 32768 / block), [&](int64_t lo, int64_t hi) {
      std::vector<float> m(block), v(block);
      for (int64_t b = lo; b < hi; ++b) {
        const int64_t start = b * block, len = std::min(block, n - start);
        const float sm = first ? 0.0f : m_scale[b], sv = first ? 0.0f : v_scale[b];
        float m_max = 0.0f, v_max = 0.0f;
        for (int64_t i = 0; i < len; ++i) {
          const int64_t k = start + i;
          float mi = first ? 0.0f : signed_map.values()[m_codes[k]] * sm;
          float vi = first ? 0.0f : unsigned_map.values()[v_codes[k]] * sv;
          const float gi = g[k];
          mi = mi * static_cast<float>(b1) + gi * static_cast<float>(1.0 - b1);
          vi = vi * static_cast<float>(b2) + static_cast<float>(1.0 - b2) * gi * gi;
          const float denom =
              std::sqrt(vi) / static_cast<float>(bc2_sqrt) + static_cast<float>(eps);
          float pi = decay != 1.0 ? p[k] * static_cast<float>(decay) : p[k];
          p[k] = pi + static_cast<float>(-step_size) * mi / denom;
          m[i] = mi, v[i] = vi;
          m_max = std::max(m_max, std::abs(mi)), v_max = std::max(v_max, vi);
        }
        const float m_div = m_max > 0 ? m_max : 1.0f, v_div = v_max > 0 ? v_max : 1.0f;
        for (int64_t i = 0; i < block; ++i) {  // the padding of the last block encodes 0
          const int64_t k = start + i;
          const float mi = i < len ? m[i] / m_div : 0.0f, vi = i < len ? v[i] / v_div : 0.0f;
          m_codes[k] = signed_map.encode(mi);
          uint8_t c = unsigned_map.encode(vi);
          if (vi > 0 && c == unsigned_map.zero()) ++c;
          v_codes[k] = c;
        }
        m_scale[b] = m_max, v_scale[b] = v_max;
      }
    });
  }
};

class AdamW8bit final : public fusebox::Optimizer {
 public:
  static void declare_schema(fusebox::Schema& s) {
    s.real("lr", 1e-3, "learning rate").above(0);
    s.real_pair("betas", {0.9, 0.999}, "decay of the first and second moments")
        .at_least(0)
        .below(1);
    s.real("eps", 1e-8, "added to the denominator").at_least(0);
    s.real("weight_decay", 1e-2, "decoupled weight decay: θ ← θ·(1 - lr·wd) before the moments")
        .at_least(0);
    s.integer("block_size", 256, "elements per quantization block (each has a float32 scale)")
        .at_least(16)
        .at_most(65536);
    s.integer("min_8bit_size", 4096, "tensors with fewer elements keep float32 moments")
        .at_least(0);
    s.flag("stochastic_rounding", false, "round bf16 parameters stochastically on write-back");
  }

  AdamW8bit(std::vector<fusebox::ParamGroup> groups, const fusebox::HyperParams& hp)
      : Optimizer(std::move(groups), hp),
        beta1_(hp.real_pair("betas").first),
        beta2_(hp.real_pair("betas").second),
        eps_(hp.real("eps")),
        block_(hp.integer("block_size")),
        min_8bit_(hp.integer("min_8bit_size")),
        stochastic_(hp.flag("stochastic_rounding")) {
    const char* aten = std::getenv("FUSEBOX_ADAMW8BIT_ATEN");
    aten_only_ = aten && std::string(aten) == "1";
  }

 protected:
  void update_param(const at::Tensor& param, fusebox::ParamState& state, size_t group) override {
    at::Tensor p = fusebox::fp32_view(param);
    at::Tensor g = param.grad().to(p.scalar_type());
    if (cpu_step(p, g, state, group)) {
      fusebox::write_back(param, p, stochastic_, rounding_seed(param));
      return;
    }
    // The moments in float32, from whichever form the state holds (a checkpoint may come from
    // another block_size or min_8bit_size: it is read in its own layout and stored in this one).
    at::Tensor m = moment(state, "exp_avg", p, true), v = moment(state, "exp_avg_sq", p, false);
    ++state.step;
    const double lr = this->lr(group);
    if (const double wd = weight_decay(group); wd != 0) p.mul_(1.0 - lr * wd);
    fusebox::adam_step_(p, g, m, v, at::Tensor(), state.step, lr, beta1_, beta2_, eps_);
    store(state, "exp_avg", m, true);
    store(state, "exp_avg_sq", v, false);
    fusebox::write_back(param, p, stochastic_, rounding_seed(param));
  }

 private:
  bool quantized(const at::Tensor& p) const { return p.numel() >= min_8bit_; }

  // The CPU path (CpuStep) when it applies: a float32 CPU parameter whose moments are 8-bit in
  // this block size, or not there yet. Everything else (float64, CUDA, a layout to convert) takes
  // the ATen path below. FUSEBOX_ADAMW8BIT_ATEN=1 forces that path (the tests compare the two).
  bool cpu_step(const at::Tensor& p, const at::Tensor& g, fusebox::ParamState& state,
                size_t group) {
    if (aten_only_ || !p.device().is_cpu() || p.scalar_type() != at::kFloat || !p.is_contiguous() ||
        !quantized(p))
      return false;
    const int64_t n = p.numel(), blocks = (n + block_ - 1) / block_;
    const bool first = state.tensors.empty();
    if (!first) {
      for (const char* key : {"exp_avg", "exp_avg_sq"}) {
        const auto codes = state.tensors.find(std::string(key) + "_codes");
        const auto scale = state.tensors.find(std::string(key) + "_scale");
        if (codes == state.tensors.end() || scale == state.tensors.end() ||
            codes->second.sizes() != at::IntArrayRef{blocks, block_} ||
            codes->second.scalar_type() != at::kByte || !codes->second.is_contiguous() ||
            scale->second.numel() != blocks || scale->second.scalar_type() != at::kFloat ||
            !scale->second.is_contiguous() || !codes->second.device().is_cpu() ||
            !scale->second.device().is_cpu())
          return false;
      }
    } else {
      const auto bytes = at::TensorOptions().dtype(at::kByte);
      state["exp_avg_codes"] = at::empty({blocks, block_}, bytes);
      state["exp_avg_sq_codes"] = at::empty({blocks, block_}, bytes);
      state["exp_avg_scale"] = at::empty({blocks}, at::kFloat);
      state["exp_avg_sq_scale"] = at::empty({blocks}, at::kFloat);
    }
    ++state.step;
    const double lr = this->lr(group);
    const CpuStep step{dynamic_map(true),
                       dynamic_map(false),
                       beta1_,
                       beta2_,
                       eps_,
                       lr / fusebox::bias_correction(beta1_, state.step),
                       std::sqrt(fusebox::bias_correction(beta2_, state.step)),
                       1.0 - lr * weight_decay(group)};
    const at::Tensor gc = g.contiguous();
    step(p.data_ptr<float>(), gc.data_ptr<float>(), state["exp_avg_codes"].data_ptr<uint8_t>(),
         state["exp_avg_scale"].data_ptr<float>(), state["exp_avg_sq_codes"].data_ptr<uint8_t>(),
         state["exp_avg_sq_scale"].data_ptr<float>(), n, block_, first);
    return true;
  }

  // The signed (first moment) or unsigned (second moment) map on `device`; made once per
  // device (the fused backward pass may call from autograd's thread of each device).
  const Codebook& codebook(bool is_signed, const at::Device& device) {
    const std::lock_guard<std::mutex> lock(mutex_);
    Codebook& book = books_[std::make_pair(is_signed, device.str())];
    if (!book.values.defined()) {
      const DynamicMap& map = dynamic_map(is_signed);
      const auto floats = at::TensorOptions().dtype(at::kFloat);
      book.values = at::tensor(map.values(), floats).to(device);
      book.midpoints = at::tensor(map.midpoints(), floats).to(device);
    }
    return book;
  }

  // The float32 moment `key` of a parameter like `p`: zeros at the first step, the float32 state
  // as it is, or the 8-bit codes ([blocks, block size], uint8) times their blocks' scales.
  at::Tensor moment(fusebox::ParamState& state, const std::string& key, const at::Tensor& p,
                    bool is_signed) {
    if (state.tensors.count(key)) return state[key];
    const auto codes = state.tensors.find(key + "_codes");
    const auto scale = state.tensors.find(key + "_scale");
    if (codes == state.tensors.end() || scale == state.tensors.end()) return at::zeros_like(p);
    const at::Tensor& c = codes->second;
    if (c.dim() != 2 || c.scalar_type() != at::kByte || c.numel() < p.numel() ||
        scale->second.numel() != c.size(0))
      throw fusebox::Error("adamw8bit: the state '" + key +
                           "_codes' does not fit this parameter (a corrupt state dict?)");
    const Codebook& book = codebook(is_signed, p.device());
    // In the working precision of `p` (float32, or float64 for a double parameter).
    return book.values.index_select(0, c.reshape({-1}).to(at::kLong))
        .to(p.scalar_type())
        .view(c.sizes())
        .mul_(scale->second.to(p.scalar_type()).unsqueeze(1))
        .reshape({-1})
        .slice(0, 0, p.numel())
        .view(p.sizes());
  }

  // Stores the float32 moment `m` under `key`: as it is for a small tensor, else as codes and
  // block scales. A positive second moment never becomes 0 (its code is at least the smallest
  // positive value): a zero would divide the update by eps alone.
  void store(fusebox::ParamState& state, const std::string& key, const at::Tensor& m,
             bool is_signed) {
    if (!quantized(m)) {
      state.tensors.erase(key + "_codes"), state.tensors.erase(key + "_scale");
      state[key] = m;
      return;
    }
    state.tensors.erase(key);
    const int64_t n = m.numel(), blocks = (n + block_ - 1) / block_;
    at::Tensor flat = m.reshape({-1});
    if (blocks * block_ != n) flat = at::constant_pad_nd(flat, {0, blocks * block_ - n}, 0);
    const at::Tensor rows = flat.view({blocks, block_});
    const at::Tensor scale = std::get<0>(rows.abs().max(1, /*keepdim=*/true));
    const at::Tensor normed = rows / at::where(scale > 0, scale, at::ones_like(scale));
    const Codebook& book = codebook(is_signed, m.device());
    at::Tensor index = at::bucketize(normed.to(at::kFloat), book.midpoints);
    if (!is_signed)
      index = at::where((normed > 0) & (index == dynamic_map(false).zero()), index + 1, index);
    state[key + "_codes"] = index.to(at::kByte);
    state[key + "_scale"] = scale.squeeze(1).contiguous();
  }

  double beta1_, beta2_, eps_;
  int64_t block_, min_8bit_;
  bool stochastic_, aten_only_ = false;
  std::mutex mutex_;
  std::map<std::pair<bool, std::string>, Codebook> books_;
};

}  // namespace

FUSEBOX_PLUGIN(AdamW8bit, "adamw8bit", "1.0.0",
               "AdamW with 8-bit block-wise quantized moments (a quarter of AdamW's state)",
               fusebox::kSupportsStepParam)
