// Tests of model/ and engine/: one block against a straightforward LibTorch
// (torch::nn) implementation of the same layer, and 20 training steps of the
// Strata trainer against a plain LibTorch training loop (torch::nn modules,
// torch::optim::AdamW, clip_grad_norm_, accumulation) from the same weights
// and data. Relative error is max|a - b| / max|b| over a tensor.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <random>

#include "config/config.h"
#include "data/dataset.h"
#include "engine/lr_schedule.h"
#include "engine/trainer.h"
#include "model/model.h"
#include "test_util.h"

namespace strata {
namespace {

double rel_err(const torch::Tensor& a, const torch::Tensor& b) {
  const double denom = b.abs().max().item<double>();
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>() /
         std::max(denom, 1e-30);
}

// ---- the reference: the same decoder written the plain torch::nn way --------

struct RMSNormImpl : torch::nn::Module {
  explicit RMSNormImpl(int64_t dim, double eps) : eps(eps) {
    weight = register_parameter("weight", torch::ones({dim}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return x / torch::sqrt(x.pow(2).mean(-1, true) + eps) * weight;
  }
  torch::Tensor weight;
  double eps;
};
TORCH_MODULE(RMSNorm);

// Rotary embedding computed from its definition: pairs (i, i + hd/2) rotated
// by angle t * theta^(-2i/hd).
torch::Tensor ref_rope(const torch::Tensor& x, double theta) {
  const int64_t T = x.size(2), hd = x.size(3), half = hd / 2;
  auto i = torch::arange(half, torch::kDouble);
  auto freq = torch::pow(theta, -2.0 * i / double(hd));
  auto ang = torch::outer(torch::arange(T, torch::kDouble), freq).to(torch::kFloat);  // [T, half]
  auto c = ang.cos(), s = ang.sin();
  auto x1 = x.slice(-1, 0, half), x2 = x.slice(-1, half, hd);
  return torch::cat({x1 * c - x2 * s, x2 * c + x1 * s}, -1);
}

struct LayerImpl : torch::nn::Module {
  LayerImpl(const ModelConfig& c) : cfg(c) {
    const int64_t d = c.dim, hd = c.head_dim();
    attn_norm = register_module("attn_norm", RMSNorm(d, c.norm_eps));
    wq = register_module("wq", torch::nn::Linear(torch::nn::LinearOptions(d, c.n_heads * hd).bias(false)));
    wk = register_module("wk", torch::nn::Linear(torch::nn::LinearOptions(d, c.kv_heads() * hd).bias(false)));
    wv = register_module("wv", torch::nn::Linear(torch::nn::LinearOptions(d, c.kv_heads() * hd).bias(false)));
    wo = register_module("wo", torch::nn::Linear(torch::nn::LinearOptions(c.n_heads * hd, d).bias(false)));
    mlp_norm = register_module("mlp_norm", RMSNorm(d, c.norm_eps));
    w1 = register_module("w1", torch::nn::Linear(torch::nn::LinearOptions(d, c.ffn_dim()).bias(false)));
    w3 = register_module("w3", torch::nn::Linear(torch::nn::LinearOptions(d, c.ffn_dim()).bias(false)));
    w2 = register_module("w2", torch::nn::Linear(torch::nn::LinearOptions(c.ffn_dim(), d).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t B = x.size(0), T = x.size(1), H = cfg.n_heads, KV = cfg.kv_heads(), hd = cfg.head_dim();
    auto a = attn_norm(x);
    auto q = ref_rope(wq(a).view({B, T, H, hd}).transpose(1, 2), cfg.rope_theta);
    auto k = ref_rope(wk(a).view({B, T, KV, hd}).transpose(1, 2), cfg.rope_theta);
    auto v = wv(a).view({B, T, KV, hd}).transpose(1, 2);
    k = k.repeat_interleave(H / KV, 1);
    v = v.repeat_interleave(H / KV, 1);
    auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(hd));
    auto mask = torch::ones({T, T}, torch::kBool).triu(1);
    scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
    auto y = torch::matmul(torch::softmax(scores, -1), v).transpose(1, 2).reshape({B, T, H * hd});
    auto h = x + wo(y);
    auto m = mlp_norm(h);
    return h + w2(torch::silu(w1(m)) * w3(m));
  }
  ModelConfig cfg;
  RMSNorm attn_norm{nullptr}, mlp_norm{nullptr};
  torch::nn::Linear wq{nullptr}, wk{nullptr}, wv{nullptr}, wo{nullptr}, w1{nullptr}, w3{nullptr}, w2{nullptr};
};
TORCH_MODULE(Layer);

struct DecoderImpl : torch::nn::Module {
  explicit DecoderImpl(const ModelConfig& c) : cfg(c) {
    emb = register_module("emb", torch::nn::Embedding(c.vocab_size, c.dim));
    for (int64_t l = 0; l < c.n_layers; ++l) layers.push_back(register_module("layer" + std::to_string(l), Layer(c)));
    final_norm = register_module("final_norm", RMSNorm(c.dim, c.norm_eps));
    if (!c.tie_embeddings) {
      out = register_module("out", torch::nn::Linear(torch::nn::LinearOptions(c.dim, c.vocab_size).bias(false)));
    }
  }
  torch::Tensor forward(const torch::Tensor& tokens) {
    auto x = emb(tokens);
    for (auto& l : layers) x = l(x);
    x = final_norm(x);
    return cfg.tie_embeddings ? torch::matmul(x, emb->weight.t()) : out(x);
  }
  ModelConfig cfg;
  torch::nn::Embedding emb{nullptr};
  std::vector<Layer> layers;
  RMSNorm final_norm{nullptr};
  torch::nn::Linear out{nullptr};
};
TORCH_MODULE(Decoder);

// The reference's parameters in Strata's block/spec order.
std::vector<std::vector<torch::Tensor>> ref_block_params(Decoder& m) {
  std::vector<std::vector<torch::Tensor>> out;
  out.push_back({m->emb->weight});
  for (auto& l : m->layers) {
    out.push_back({l->attn_norm->weight, l->wq->weight, l->wk->weight, l->wv->weight, l->wo->weight,
                   l->mlp_norm->weight, l->w1->weight, l->w3->weight, l->w2->weight});
  }
  std::vector<torch::Tensor> head{m->final_norm->weight};
  if (!m->cfg.tie_embeddings) head.push_back(m->out->weight);
  out.push_back(head);
  return out;
}

ModelConfig small_model(bool tied, int64_t kv_heads) {
  ModelConfig c;
  c.vocab_size = 256;
  c.dim = 64;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = kv_heads;
  c.ffn_hidden = 96;
  c.seq_len = 32;
  c.tie_embeddings = tied;
  return c;
}

// ---- one block --------------------------------------------------------------

TEST(ModelTest, LayerForwardAndGradientsMatchTorchNn) {
  torch::manual_seed(0);
  const ModelConfig c = small_model(true, 2);
  Model model(c);
  StateLayout layout(model.layout_specs(), 1);
  const BlockLayout& bl = layout.block(1);  // layer.0
  ASSERT_EQ(bl.name, "layer.0");
  torch::Tensor flat = torch::zeros({bl.padded_numel});
  init_block(bl, flat, 42, 1);
  // Norm weights are ones at init; perturb them so their gradient path is tested.
  std::vector<torch::Tensor> views = param_views(bl, flat);
  views[0].add_(torch::randn_like(views[0]) * 0.1);
  views[5].add_(torch::randn_like(views[5]) * 0.1);

  Layer ref(c);
  {
    torch::NoGradGuard ng;
    auto ps = std::vector<torch::Tensor>{ref->attn_norm->weight, ref->wq->weight, ref->wk->weight,
                                         ref->wv->weight, ref->wo->weight, ref->mlp_norm->weight,
                                         ref->w1->weight, ref->w3->weight, ref->w2->weight};
    for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(views[i]);
  }
  torch::Tensor x = torch::randn({3, c.seq_len, c.dim});
  torch::Tensor dy = torch::randn({3, c.seq_len, c.dim});

  // Strata: leaves over the views, as the trainer makes them.
  std::vector<torch::Tensor> leaves;
  for (auto& v : views) leaves.push_back(v.detach().requires_grad_(true));
  torch::Tensor xs = x.clone().requires_grad_(true);
  torch::Tensor ys = model.forward(1, leaves, xs);
  ys.backward(dy);

  torch::Tensor xr = x.clone().requires_grad_(true);
  torch::Tensor yr = ref->forward(xr);
  yr.backward(dy);

  EXPECT_LE(rel_err(ys, yr), 1e-6);
  EXPECT_LE(rel_err(xs.grad(), xr.grad()), 1e-6);
  auto named = std::vector<torch::Tensor>{ref->attn_norm->weight, ref->wq->weight, ref->wk->weight,
                                          ref->wv->weight, ref->wo->weight, ref->mlp_norm->weight,
                                          ref->w1->weight, ref->w3->weight, ref->w2->weight};
  for (size_t i = 0; i < named.size(); ++i) {
    EXPECT_LE(rel_err(leaves[i].grad(), named[i].grad()), 1e-6) << bl.params[i].spec.name;
  }
}

// Llama 3.1's rope scaling from its definition: frequencies whose wavelength
// is shorter than original / high_freq_factor are kept, longer than
// original / low_freq_factor divided by the factor, and those between lie
// strictly between the two; linear divides every one by the factor.
TEST(ModelTest, RopeScalingKeepsStretchesAndInterpolates) {
  const int64_t hd = 64;
  at::Tensor inv = at::pow(500000.0, at::arange(0, hd, 2, at::kDouble) / double(hd)).reciprocal();
  RopeScaling r;
  r.type = RopeType::kLlama3;
  r.factor = 8.0;
  r.low_freq_factor = 1.0;
  r.high_freq_factor = 4.0;
  r.original_max_position_embeddings = 8192;
  const at::Tensor s = scaled_inv_freq(inv, r);
  int kept = 0, stretched = 0, between = 0;
  for (int64_t i = 0; i < inv.numel(); ++i) {
    const double f = inv[i].item<double>(), g = s[i].item<double>(), wavelen = 2 * M_PI / f;
    if (wavelen < 8192.0 / 4.0) {
      EXPECT_EQ(g, f) << i;
      ++kept;
    } else if (wavelen > 8192.0) {
      EXPECT_DOUBLE_EQ(g, f / 8.0) << i;
      ++stretched;
    } else {
      EXPECT_LT(g, f) << i;
      EXPECT_GT(g, f / 8.0) << i;
      ++between;
    }
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(stretched, 0);
  EXPECT_GT(between, 0);
  r.type = RopeType::kLinear;
  r.factor = 4.0;
  EXPECT_TRUE(at::allclose(scaled_inv_freq(inv, r), inv / 4.0, 0.0, 0.0));
  r.type = RopeType::kNone;
  EXPECT_TRUE(at::equal(scaled_inv_freq(inv, r), inv));
}

// Each family's layer: Qwen2 adds q/k/v biases, Qwen3 per-head q/k norms
// (with an explicit head_dim), after Llama's nine weights in the same order.
TEST(ModelTest, FamiliesAddTheirParametersAfterLlamas) {
  ModelConfig m;
  m.dim = 64;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  const std::vector<ParamSpec> llama = model_blocks(m)[1].params;
  ASSERT_EQ(llama.size(), 9u);
  m.family = ModelFamily::kQwen2;
  const std::vector<ParamSpec> qwen2 = model_blocks(m)[1].params;
  ASSERT_EQ(qwen2.size(), 12u);
  EXPECT_EQ(qwen2[9].name, "bq");
  EXPECT_EQ(qwen2[9].shape, (std::vector<int64_t>{64}));
  EXPECT_EQ(qwen2[10].shape, (std::vector<int64_t>{32}));
  m.family = ModelFamily::kQwen3;
  m.explicit_head_dim = 32;
  const std::vector<ParamSpec> qwen3 = model_blocks(m)[1].params;
  ASSERT_EQ(qwen3.size(), 11u);
  EXPECT_EQ(qwen3[1].shape, (std::vector<int64_t>{128, 64}));  // wq: 4 heads of 32
  EXPECT_EQ(qwen3[4].shape, (std::vector<int64_t>{64, 128}));  // wo
  EXPECT_EQ(qwen3[9].name, "q_norm");
  EXPECT_EQ(qwen3[9].shape, (std::vector<int64_t>{32}));
  for (size_t i = 0; i < 9; ++i) EXPECT_EQ(qwen2[i].name, llama[i].name);
}

// Note [Initial weights]: chunked draws, the same whatever the thread count,
// each chunk from its own seed, with the distribution each parameter asks for.
TEST(ModelTest, InitialWeightsDependOnSeedAndShapeNotThreads) {
  ModelConfig c = small_model(false, 0);
  c.dim = 1024;
  c.ffn_hidden = 1536;  // w1, w3, w2: 1.5 Mi elements, two chunks each
  Model model(c);
  StateLayout layout(model.layout_specs(), 1);
  const BlockLayout& l0 = layout.block(1);
  const BlockLayout& l1 = layout.block(2);
  ASSERT_EQ(l0.name, "layer.0");
  const int threads = at::get_num_threads();
  auto draw = [&](const BlockLayout& bl, size_t index, int n_threads) {
    at::set_num_threads(n_threads);
    torch::Tensor flat = torch::full({bl.padded_numel}, -7.0f);
    init_block(bl, flat, 1234, index);
    at::set_num_threads(threads);
    return flat;
  };
  const torch::Tensor one = draw(l0, 1, 1), two = draw(l0, 1, 2);
  EXPECT_TRUE(torch::equal(one, two)) << "the weights depend on the thread count";
  ASSERT_EQ(l1.padded_numel, l0.padded_numel);
  EXPECT_FALSE(torch::equal(one, draw(l1, 2, 2))) << "layer.1 drew layer.0's values";
  const torch::Tensor other_seed = torch::zeros({l0.padded_numel});
  init_block(l0, other_seed, 1235, 1);
  EXPECT_FALSE(torch::equal(one.narrow(0, 0, l0.numel), other_seed.narrow(0, 0, l0.numel)));
  // Padding is left alone.
  if (l0.padded_numel > l0.numel) {
    EXPECT_TRUE(torch::all(one.narrow(0, l0.numel, l0.padded_numel - l0.numel) == -7.0f).item<bool>());
  }
  std::vector<torch::Tensor> views = param_views(l0, one);
  int multi_chunk = 0;
  for (size_t i = 0; i < l0.params.size(); ++i) {
    const ParamSpec& s = l0.params[i].spec;
    const torch::Tensor v = views[i].reshape({-1});
    if (s.init == Init::kOnes) {
      EXPECT_TRUE(torch::all(v == 1.0f).item<bool>()) << s.name;
      continue;
    }
    ASSERT_EQ(s.init, Init::kNormal) << s.name;
    EXPECT_NEAR(v.std().item<double>(), s.std, 0.02 * s.std) << s.name;
    EXPECT_NEAR(v.mean().item<double>(), 0.0, 0.05 * s.std) << s.name;
    // Chunk k is the first draws of its own generator.
    for (int64_t k = 0; k * kInitChunk < v.numel(); ++k) {
      const int64_t count = std::min(kInitChunk, v.numel() - k * kInitChunk);
      at::Generator gen = at::detail::createCPUGenerator(init_chunk_seed(1234, 1, i, k));
      const torch::Tensor expect = torch::empty({count}).normal_(0.0, s.std, gen);
      EXPECT_TRUE(torch::equal(v.narrow(0, k * kInitChunk, count), expect)) << s.name << " chunk " << k;
    }
    if (v.numel() > kInitChunk) {
      ++multi_chunk;
      const int64_t n = std::min(kInitChunk, v.numel() - kInitChunk);
      EXPECT_FALSE(torch::equal(v.narrow(0, 0, n), v.narrow(0, kInitChunk, n))) << s.name << ": chunks repeat";
    }
  }
  EXPECT_EQ(multi_chunk, 3) << "w1, w3 and w2 span two chunks";
}

TEST(ModelTest, ParamViewsShareTheFlatBufferAndLayoutIsAligned) {
  const ModelConfig c = small_model(false, 0);
  Model model(c);
  StateLayout layout(model.layout_specs(), 3);
  int64_t expect_offset = 0;
  for (const BlockLayout& b : layout.blocks()) {
    EXPECT_EQ(b.offset, expect_offset);
    EXPECT_EQ(b.padded_numel % (3 * kShardAlignElems), 0);
    EXPECT_GE(b.padded_numel, b.numel);
    expect_offset += b.padded_numel;
  }
  torch::Tensor flat = torch::zeros({layout.total_numel()});
  const BlockLayout& head = layout.block(layout.num_blocks() - 1);
  auto views = param_views(head, flat.narrow(0, head.offset, head.padded_numel));
  ASSERT_EQ(views.size(), 2u);  // untied: final_norm + output
  views[1].fill_(3.0f);
  EXPECT_EQ(flat.sum().item<double>(), 3.0 * double(c.vocab_size * c.dim));
}

// ---- training equivalence ---------------------------------------------------

Config train_config(const std::string& data_path, bool tied) {
  nlohmann::json j = {
      {"train_micro_batch_size_per_gpu", 4},
      {"gradient_accumulation_steps", 2},
      {"gradient_clipping", 0.5},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"betas", {0.9, 0.95}}, {"eps", 1e-8}, {"weight_decay", 0.1}}}}},
      {"scheduler", {{"type", "WarmupCosineLR"}, {"params", {{"total_num_steps", 20}, {"warmup_num_steps", 5}, {"warmup_type", "linear"}}}}},
      {"model", {{"dim", 64}, {"n_layers", 2}, {"n_heads", 4}, {"n_kv_heads", 2}, {"ffn_hidden", 96}, {"seq_len", 32}, {"tie_embeddings", tied}}},
      {"data", {{"path", data_path}, {"val_fraction", 0.0}}},
      {"run", {{"steps", 20}, {"seed", 7}}},
  };
  return parse_config(j);
}

void expect_training_matches_torch(bool tied) {
  testing::TempDir dir;
  const std::string path = dir.write("text.txt", testing::sample_text(20000));
  Config cfg = train_config(path, tied);
  ASSERT_EQ(cfg.train_batch_size, 8);
  Model model(cfg.model);
  Trainer trainer(cfg, model);
  TokenDataset data(cfg.data.paths, TokenFormat::kText, 256, cfg.model.seq_len, 0.0);

  Decoder ref(cfg.model);
  auto ref_params = ref_block_params(ref);
  {
    torch::NoGradGuard ng;
    for (size_t b = 0; b < ref_params.size(); ++b) {
      auto w = trainer.block_weights(b);
      for (size_t i = 0; i < w.size(); ++i) ref_params[b][i].copy_(w[i]);
    }
  }
  torch::optim::AdamW opt(ref->parameters(), torch::optim::AdamWOptions(3e-3).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1));

  const int64_t micro = 4, accum = 2, window = cfg.model.seq_len + 1;
  std::vector<int64_t> batch(size_t(accum * micro * window));
  std::mt19937_64 rng(123);
  double first = 0, last = 0;
  for (int step = 1; step <= 20; ++step) {
    data.sample_train(rng, accum * micro, batch.data());
    StepResult r = trainer.step(batch.data());

    opt.zero_grad();
    double ref_loss = 0;
    auto all = torch::from_blob(batch.data(), {accum * micro, window}, torch::kLong);
    for (int64_t m = 0; m < accum; ++m) {
      auto b = all.narrow(0, m * micro, micro);
      auto logits = ref->forward(b.narrow(1, 0, cfg.model.seq_len));
      auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, 256}),
                                                       b.narrow(1, 1, cfg.model.seq_len).reshape({-1}));
      (loss / double(accum)).backward();
      ref_loss += loss.item<double>() / double(accum);
    }
    const double norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), 0.5);
    const double lr = learning_rate(cfg.scheduler, cfg.optimizer.lr, step);
    static_cast<torch::optim::AdamWOptions&>(opt.param_groups()[0].options()).lr(lr);
    opt.step();

    EXPECT_NEAR(r.loss, ref_loss, 1e-5 * std::abs(ref_loss)) << "step " << step;
    EXPECT_NEAR(r.grad_norm, norm, 1e-4 * norm) << "step " << step;
    EXPECT_DOUBLE_EQ(r.lr, lr);
    if (step == 1) first = r.loss;
    last = r.loss;
  }
  EXPECT_LT(last, first - 0.5);  // it learned something: the comparison is not of two stuck runs
  // Final parameters agree too.
  for (size_t b = 0; b < ref_params.size(); ++b) {
    auto w = trainer.block_weights(b);
    for (size_t i = 0; i < w.size(); ++i) EXPECT_LE(rel_err(w[i], ref_params[b][i]), 1e-4);
  }
}

TEST(TrainTest, TwentyStepsMatchPlainLibTorchTied) { expect_training_matches_torch(true); }
TEST(TrainTest, TwentyStepsMatchPlainLibTorchUntied) { expect_training_matches_torch(false); }

TEST(TrainTest, Bf16ComputeTrainsAndKeepsFp32Master) {
  testing::TempDir dir;
  const std::string path = dir.write("text.txt", testing::sample_text(20000));
  Config cfg = train_config(path, true);
  cfg = parse_config(cfg.raw, {"bf16.enabled=true"});
  Model model(cfg.model);
  Trainer trainer(cfg, model);
  EXPECT_EQ(trainer.compute_dtype(), at::kBFloat16);
  EXPECT_EQ(trainer.block_weights(1)[1].scalar_type(), at::kBFloat16);
  EXPECT_EQ(trainer.master_block(1).scalar_type(), at::kFloat);
  TokenDataset data(cfg.data.paths, TokenFormat::kText, 256, cfg.model.seq_len, 0.0);
  std::vector<int64_t> batch(size_t(8 * 33));
  std::mt19937_64 rng(1);
  double first = 0, last = 0;
  for (int s = 1; s <= 20; ++s) {
    data.sample_train(rng, 8, batch.data());
    auto r = trainer.step(batch.data());
    if (s == 1) first = r.loss;
    last = r.loss;
  }
  EXPECT_LT(last, first - 0.5);
  // The working copy is the master rounded to bf16.
  EXPECT_TRUE(torch::equal(trainer.block_weights(1)[1],
                           param_views(trainer.layout().block(1), trainer.master_block(1))[1]
                               .to(torch::kBFloat16)));
}

TEST(TrainTest, PaddingStaysZero) {
  testing::TempDir dir;
  const std::string path = dir.write("text.txt", testing::sample_text(20000));
  Config cfg = train_config(path, true);
  Model model(cfg.model);
  Trainer trainer(cfg, model);
  TokenDataset data(cfg.data.paths, TokenFormat::kText, 256, cfg.model.seq_len, 0.0);
  std::vector<int64_t> batch(size_t(8 * 33));
  std::mt19937_64 rng(1);
  for (int s = 0; s < 3; ++s) {
    data.sample_train(rng, 8, batch.data());
    trainer.step(batch.data());
  }
  for (size_t i = 0; i < trainer.layout().num_blocks(); ++i) {
    const BlockLayout& b = trainer.layout().block(i);
    auto pad = trainer.master_block(i).narrow(0, b.numel, b.padded_numel - b.numel);
    EXPECT_EQ(pad.abs().sum().item<double>(), 0.0) << b.name;
  }
}

}  // namespace
}  // namespace strata
