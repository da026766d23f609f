// The built-in models, written with torch::nn.
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <numeric>
#include <unordered_set>

#include "fusebox/core/activation_checkpoint.h"
#include "fusebox/core/autocast.h"
#include "fusebox/core/checkpoint.h"
#include "fusebox/core/messages.h"
#include "fusebox/core/safetensors.h"
#include "fusebox/error.h"
#include "model.h"

namespace fusebox::trainer {

namespace nn = torch::nn;
namespace F = torch::nn::functional;

std::vector<std::pair<std::string, at::Tensor>> unique_parameters(
    std::vector<std::pair<std::string, at::Tensor>> named) {
  std::unordered_set<const void*> seen;
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& [name, t] : named)
    if (seen.insert(t.unsafeGetTensorImpl()).second) out.emplace_back(name, t);
  return out;
}

int64_t count_elements(const std::vector<std::pair<std::string, at::Tensor>>& params) {
  int64_t n = 0;
  for (const auto& p : params) n += p.second.numel();
  return n;
}

namespace {

// Runs one block, `f(inputs)`; with gradient checkpointing it keeps only `inputs` and runs the
// block again in backward (the module's trainable parameters get their gradients as usual).
torch::Tensor run_block(bool checkpointing, nn::Module& module,
                        const std::vector<torch::Tensor>& inputs, const Segment& f) {
  if (!checkpointing) return f(inputs);
  std::vector<torch::Tensor> params;
  for (const auto& p : module.parameters())
    if (p.requires_grad()) params.push_back(p);
  return recompute_in_backward(f, inputs, params);
}

// ---------------------------------------------------------------- MLP
struct MlpImpl : nn::Module {
  explicit MlpImpl(const ModelOptions& o) : checkpointing(o.gradient_checkpointing) {
    layers = register_module("layers", nn::ModuleList());
    for (int64_t i = 0; i < o.depth; ++i) layers->push_back(nn::Linear(o.width, o.width));
    head = register_module("head", nn::Linear(o.width, 1));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& l : *layers) {
      auto& layer = *l->as<nn::Linear>();
      x = run_block(checkpointing, layer, {x}, [&layer](const std::vector<torch::Tensor>& in) {
        return F::gelu(layer.forward(in[0]));
      });
    }
    return head->forward(x);
  }
  bool checkpointing;
  nn::ModuleList layers{nullptr};
  nn::Linear head{nullptr};
};
TORCH_MODULE(Mlp);

// ---------------------------------------------------------------- transformer
struct BlockImpl : nn::Module {
  BlockImpl(int64_t d, int64_t heads) : heads(heads) {
    ln1 = register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({d})));
    qkv = register_module("qkv", nn::Linear(d, 3 * d));
    proj = register_module("proj", nn::Linear(d, d));
    ln2 = register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({d})));
    fc1 = register_module("fc1", nn::Linear(d, 4 * d));
    fc2 = register_module("fc2", nn::Linear(4 * d, d));
  }
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& causal_mask) {
    const int64_t b = x.size(0), t = x.size(1), d = x.size(2), hd = d / heads;
    auto parts = qkv->forward(ln1->forward(x)).chunk(3, -1);
    auto split = [&](const torch::Tensor& y) { return y.view({b, t, heads, hd}).transpose(1, 2); };
    torch::Tensor q = split(parts[0]), k = split(parts[1]), v = split(parts[2]);
    torch::Tensor att = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
    att = att.masked_fill(causal_mask, -std::numeric_limits<float>::infinity()).softmax(-1);
    torch::Tensor y = torch::matmul(att, v).transpose(1, 2).reshape({b, t, d});
    x = x + proj->forward(y);
    return x + fc2->forward(F::gelu(fc1->forward(ln2->forward(x))));
  }
  int64_t heads;
  nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

struct LanguageModelImpl : nn::Module {
  explicit LanguageModelImpl(const ModelOptions& o)
      : vocab(o.vocab_size), checkpointing(o.gradient_checkpointing) {
    tok = register_module("tok", nn::Embedding(nn::EmbeddingOptions(o.vocab_size, o.width)));
    nn::init::normal_(tok->weight, 0.0, 0.02);
    pos = register_parameter("pos", torch::randn({o.seq_len, o.width}) * 0.02);
    blocks = register_module("blocks", nn::ModuleList());
    for (int64_t i = 0; i < o.depth; ++i) blocks->push_back(Block(o.width, o.heads));
    ln_f = register_module("ln_f", nn::LayerNorm(nn::LayerNormOptions({o.width})));
  }
  // tokens [B, T] -> logits [B, T, V]; the output head is the token embedding (tied).
  torch::Tensor forward(const torch::Tensor& tokens) {
    const int64_t t = tokens.size(1);
    torch::Tensor x = tok->forward(tokens) + pos.slice(0, 0, t);
    torch::Tensor mask =
        torch::ones({t, t}, torch::TensorOptions().dtype(torch::kBool).device(tokens.device()))
            .triu(1);
    for (auto& b : *blocks) {
      auto& block = *b->as<Block>();
      x = run_block(checkpointing, block, {x},
                    [&block, mask](const std::vector<torch::Tensor>& in) {
                      return block.forward(in[0], mask);
                    });
    }
    return torch::matmul(ln_f->forward(x), tok->weight.t());
  }
  int64_t vocab;
  bool checkpointing;
  nn::Embedding tok{nullptr};
  torch::Tensor pos;
  nn::ModuleList blocks{nullptr};
  nn::LayerNorm ln_f{nullptr};
};
TORCH_MODULE(LanguageModel);

// ---------------------------------------------------------------- denoiser (small UNet)
int64_t norm_groups(int64_t channels) { return std::gcd<int64_t>(8, channels); }

// Group norm in its weights' dtype. LibTorch 1.13's CPU kernel wants input and weights of one
// dtype, and its CPU autocast passes group_norm bf16 activations with float weights; under
// autocast this runs it in float32, as CUDA autocast runs group_norm.
torch::Tensor group_norm(nn::GroupNormImpl& norm, const torch::Tensor& x) {
  return norm.forward(x.to(norm.weight.scalar_type()));
}

// A transposed convolution that would run in bf16 on the CPU (bf16 input or weights, or bf16
// autocast) runs in float32 with autocast off, and its result is cast back to bf16: LibTorch
// 1.13's mkldnn bf16 kernel checks the input against the wrong channel count when the input and
// output channels differ ("weight of size [128, 64, 4, 4], expected input[8, 128, 8, 8] to have 64
// channels"). Autograd carries the gradients through the casts. On CUDA the bf16 kernels work and
// stay in use.
torch::Tensor transposed_conv(nn::ConvTranspose2dImpl& conv, const torch::Tensor& x) {
  const bool bf16 = x.scalar_type() == torch::kBFloat16 ||
                    conv.weight.scalar_type() == torch::kBFloat16 ||
                    active_autocast_dtype(c10::kCPU) == torch::kBFloat16;
  if (!x.device().is_cpu() || !bf16) return conv.forward(x);
  AutocastOffGuard off(c10::kCPU);
  const auto& o = conv.options;
  using std::get;  // a transposed convolution's padding is numbers; c10::get (1.13) through ADL
  auto f = F::ConvTranspose2dFuncOptions()
               .stride(o.stride())
               .padding(get<torch::ExpandingArray<2>>(o.padding()))
               .output_padding(o.output_padding())
               .groups(o.groups())
               .dilation(o.dilation());
  if (conv.bias.defined()) f.bias(conv.bias.to(torch::kFloat));
  return F::conv_transpose2d(x.to(torch::kFloat), conv.weight.to(torch::kFloat), f)
      .to(torch::kBFloat16);
}

struct ResBlockImpl : nn::Module {
  ResBlockImpl(int64_t in, int64_t out, int64_t temb) {
    norm1 = register_module("norm1", nn::GroupNorm(norm_groups(in), in));
    conv1 = register_module("conv1", nn::Conv2d(nn::Conv2dOptions(in, out, 3).padding(1)));
    time = register_module("time", nn::Linear(temb, out));
    norm2 = register_module("norm2", nn::GroupNorm(norm_groups(out), out));
    conv2 = register_module("conv2", nn::Conv2d(nn::Conv2dOptions(out, out, 3).padding(1)));
    if (in != out) skip = register_module("skip", nn::Conv2d(nn::Conv2dOptions(in, out, 1)));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& temb) {
    torch::Tensor h = conv1->forward(F::silu(group_norm(*norm1, x)));
    h = h + time->forward(temb).unsqueeze(-1).unsqueeze(-1);
    h = conv2->forward(F::silu(group_norm(*norm2, h)));
    return h + (skip ? skip->forward(x) : x);
  }
  nn::GroupNorm norm1{nullptr}, norm2{nullptr};
  nn::Conv2d conv1{nullptr}, conv2{nullptr}, skip{nullptr};
  nn::Linear time{nullptr};
};
TORCH_MODULE(ResBlock);

struct DenoiserImpl : nn::Module {
  explicit DenoiserImpl(const ModelOptions& o)
      : width(o.width), levels(o.depth), checkpointing(o.gradient_checkpointing) {
    const int64_t temb = 2 * width;
    time1 = register_module("time1", nn::Linear(width, temb));
    time2 = register_module("time2", nn::Linear(temb, temb));
    in_conv = register_module("in_conv",
                              nn::Conv2d(nn::Conv2dOptions(kImageChannels, width, 3).padding(1)));
    down = register_module("down", nn::ModuleList());
    downsample = register_module("downsample", nn::ModuleList());
    up = register_module("up", nn::ModuleList());
    upsample = register_module("upsample", nn::ModuleList());
    for (int64_t i = 0; i < levels; ++i) {
      down->push_back(ResBlock(ch(i), ch(i), temb));
      if (i + 1 < levels)
        downsample->push_back(
            nn::Conv2d(nn::Conv2dOptions(ch(i), ch(i + 1), 3).stride(2).padding(1)));
    }
    mid = register_module("mid", ResBlock(ch(levels - 1), ch(levels - 1), temb));
    for (int64_t i = levels - 1; i >= 0; --i) {
      up->push_back(ResBlock(2 * ch(i), ch(i), temb));
      if (i > 0)
        upsample->push_back(nn::ConvTranspose2d(
            nn::ConvTranspose2dOptions(ch(i), ch(i - 1), 4).stride(2).padding(1)));
    }
    out_norm = register_module("out_norm", nn::GroupNorm(norm_groups(width), width));
    out_conv = register_module("out_conv",
                               nn::Conv2d(nn::Conv2dOptions(width, kImageChannels, 3).padding(1)));
    // DDPM's linear beta schedule; alpha_bar[t] is the signal fraction kept at step t.
    torch::Tensor betas = torch::linspace(1e-4, 0.02, kDiffusionSteps, torch::kDouble);
    // A plain double tensor on the CPU (not a buffer), so --full-bf16 does not round it.
    alpha_bar = (1 - betas).cumprod(0);
  }
  int64_t ch(int64_t level) const { return width << std::min<int64_t>(level, 2); }

  torch::Tensor time_embedding(const torch::Tensor& t, c10::ScalarType dtype) {
    const int64_t half = width / 2;
    torch::Tensor freqs = torch::exp(
        -std::log(10000.0) *
        torch::arange(half, torch::TensorOptions().dtype(torch::kFloat).device(t.device())) /
        std::max<int64_t>(half, 1));
    torch::Tensor args = t.to(torch::kFloat).unsqueeze(1) * freqs.unsqueeze(0);
    torch::Tensor emb = torch::cat({args.sin(), args.cos()}, 1);
    if (emb.size(1) < width) emb = F::pad(emb, F::PadFuncOptions({0, width - emb.size(1)}));
    emb = emb.to(dtype);
    return time2->forward(F::silu(time1->forward(emb)));
  }

  torch::Tensor res_block(ResBlockImpl& block, const torch::Tensor& x, const torch::Tensor& temb) {
    return run_block(
        checkpointing, block, {x, temb},
        [&block](const std::vector<torch::Tensor>& in) { return block.forward(in[0], in[1]); });
  }

  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t) {
    torch::Tensor temb = time_embedding(t, x.scalar_type());
    torch::Tensor h = in_conv->forward(x);
    std::vector<torch::Tensor> skips;
    for (int64_t i = 0; i < levels; ++i) {
      h = res_block(*down[i]->as<ResBlock>(), h, temb);
      skips.push_back(h);
      if (i + 1 < levels) h = downsample[i]->as<nn::Conv2d>()->forward(h);
    }
    // The middle block is never recomputed: its input is also a skip connection, so its
    // gradient gathers three contributions, and a recomputed block would add its own two first,
    // changing the rounding of the sum. Every other block's input is used by that block alone.
    h = mid->forward(h, temb);
    for (int64_t j = 0; j < levels; ++j) {
      const int64_t i = levels - 1 - j;
      h = res_block(*up[j]->as<ResBlock>(), torch::cat({h, skips[i]}, 1), temb);
      if (i > 0) h = transposed_conv(*upsample[j]->as<nn::ConvTranspose2d>(), h);
    }
    return out_conv->forward(F::silu(group_norm(*out_norm, h)));
  }

  // Noise-prediction loss: x_t = sqrt(ab) x0 + sqrt(1 - ab) eps, MSE(model(x_t, t), eps).
  torch::Tensor loss(const torch::Tensor& x0, const torch::Tensor& noise, const torch::Tensor& t) {
    // Noising happens in the loss's precision; the model then sees its own parameter dtype.
    torch::Tensor ab = alpha_bar.index_select(0, t.cpu())
                           .to(noise.device(), noise.scalar_type())
                           .view({-1, 1, 1, 1});
    torch::Tensor xt = ab.sqrt() * x0.to(noise.scalar_type()) + (1 - ab).sqrt() * noise;
    xt = xt.to(in_conv->weight.scalar_type());
    return F::mse_loss(forward(xt, t).to(noise.scalar_type()), noise);
  }

  int64_t width, levels;
  bool checkpointing;
  nn::Linear time1{nullptr}, time2{nullptr};
  nn::Conv2d in_conv{nullptr}, out_conv{nullptr};
  nn::ModuleList down{nullptr}, downsample{nullptr}, up{nullptr}, upsample{nullptr};
  ResBlock mid{nullptr};
  nn::GroupNorm out_norm{nullptr};
  torch::Tensor alpha_bar;
};
TORCH_MODULE(Denoiser);

// ---------------------------------------------------------------- the Model wrapper
template <class M>
class BuiltinModel : public Model {
 public:
  BuiltinModel(M module, ModelOptions o) : m_(std::move(module)), o_(std::move(o)) {
    m_->to(o_.device, o_.dtype);
    m_->train();
  }
  std::vector<std::pair<std::string, at::Tensor>> parameters() override {
    std::vector<std::pair<std::string, at::Tensor>> named;
    // Every parameter, trained or frozen (--freeze): checkpoints and --save-model hold them all.
    for (const auto& item : m_->named_parameters(/*recurse=*/true))
      named.emplace_back(item.key(), item.value());
    return unique_parameters(std::move(named));
  }
  at::Tensor loss(const Batch& b) override;
  void set_training(bool on) override { m_->train(on); }
  std::string describe() override {
    char buf[256];
    std::snprintf(buf, sizeof buf, "%s (width %lld, depth %lld): %lld parameters in %zu tensors",
                  o_.kind.c_str(), static_cast<long long>(o_.width),
                  static_cast<long long>(o_.depth),
                  static_cast<long long>(count_elements(parameters())), parameters().size());
    return buf;
  }
  void save(const std::string& path, std::optional<c10::ScalarType> as) override {
    write_weights(parameters(), path, as);
  }

 private:
  M m_;
  ModelOptions o_;
};

template <>
at::Tensor BuiltinModel<Mlp>::loss(const Batch& b) {
  return F::mse_loss(m_->forward(b.input).to(b.target.scalar_type()), b.target);
}
template <>
at::Tensor BuiltinModel<LanguageModel>::loss(const Batch& b) {
  torch::Tensor logits = m_->forward(b.input);
  logits = logits.reshape({-1, logits.size(-1)});
  if (logits.scalar_type() == torch::kBFloat16 || logits.scalar_type() == torch::kHalf)
    logits = logits.to(torch::kFloat);  // the loss itself in fp32
  return F::cross_entropy(logits, b.target.reshape({-1}));
}
template <>
at::Tensor BuiltinModel<Denoiser>::loss(const Batch& b) {
  return m_->loss(b.input, b.noise, b.timesteps);
}

}  // namespace

void write_weights(const std::vector<std::pair<std::string, at::Tensor>>& named,
                   const std::string& path, std::optional<c10::ScalarType> as) {
  std::vector<std::pair<std::string, at::Tensor>> out = named;
  if (as)
    for (auto& [name, t] : out)
      if (t.is_floating_point()) t = t.detach().to(*as);
  if (is_safetensors_path(path))
    fusebox::save_safetensors(out, path);
  else
    fusebox::save_model_weights(out, path);
}

void save_via_temporary(const std::string& path,
                        const std::function<void(const std::string&)>& write) {
  const std::string tmp = temporary_path(path).string();
  try {
    write(tmp);
    std::filesystem::rename(tmp, path);
  } catch (const std::exception& e) {
    std::error_code ec;
    std::filesystem::remove(tmp, ec);
    throw Error("cannot write model to " + path + ": " + first_line(e.what()));
  }
}

double builtin_parameter_count(const ModelOptions& o) {
  const double w = static_cast<double>(o.width), depth = static_cast<double>(o.depth);
  auto linear = [](double in, double out) { return in * out + out; };
  auto conv = [](double in, double out, double k) { return in * out * k * k + out; };
  if (o.kind == "mlp") return depth * linear(w, w) + linear(w, 1);
  if (o.kind == "transformer") {
    const double block = 2 * (2 * w) + linear(w, 3 * w) + linear(w, w) + linear(w, 4 * w) +
                         linear(4 * w, w);  // two layer norms, qkv, proj, fc1, fc2
    return static_cast<double>(o.vocab_size) * w + static_cast<double>(o.seq_len) * w +
           depth * block + 2 * w;
  }
  if (o.kind == "denoiser") {
    // As DenoiserImpl and ResBlockImpl build it.
    const double temb = 2 * w;
    auto ch = [&](int64_t level) {
      return w * static_cast<double>(1 << std::min<int64_t>(level, 2));
    };
    auto res_block = [&](double in, double out) {
      return 2 * in + conv(in, out, 3) + linear(temb, out) + 2 * out + conv(out, out, 3) +
             (in != out ? conv(in, out, 1) : 0);
    };
    double n = linear(w, temb) + linear(temb, temb) + conv(kImageChannels, w, 3);
    for (int64_t i = 0; i < o.depth; ++i) {
      n += res_block(ch(i), ch(i));
      if (i + 1 < o.depth) n += conv(ch(i), ch(i + 1), 3);
    }
    n += res_block(ch(o.depth - 1), ch(o.depth - 1));
    for (int64_t i = o.depth - 1; i >= 0; --i) {
      n += res_block(2 * ch(i), ch(i));
      if (i > 0) n += conv(ch(i), ch(i - 1), 4);  // transposed: weight [in, out, 4, 4]
    }
    return n + 2 * w + conv(w, kImageChannels, 3);
  }
  throw Error("unknown model '" + o.kind + "'");
}

std::unique_ptr<Model> make_builtin_model(const ModelOptions& o) {
  if (o.kind == "mlp") return std::make_unique<BuiltinModel<Mlp>>(Mlp(o), o);
  if (o.kind == "transformer")
    return std::make_unique<BuiltinModel<LanguageModel>>(LanguageModel(o), o);
  if (o.kind == "denoiser") return std::make_unique<BuiltinModel<Denoiser>>(Denoiser(o), o);
  throw Error("unknown model '" + o.kind + "'");
}

}  // namespace fusebox::trainer
