// A layer's explicit forward and backward with named saved tensors (Note
// [Saved activations] in src/model/layer_ops.cc) against autograd's path over
// Model::forward, per family and dtype; cheap entries recomputed give the same
// bits as kept ones; the entries' sizes against sizes worked out by hand.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "memory/layout.h"
#include "model/cross_entropy.h"
#include "model/model.h"
#include "model/saved_activations.h"
#include "util/errors.h"

namespace strata {
namespace {

double rel_err(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor bd = b.to(at::kDouble);
  const double denom = std::max(bd.abs().max().item<double>(), 1e-30);
  return (a.to(at::kDouble) - bd).abs().max().item<double>() / denom;
}

ModelConfig family_model(ModelFamily family) {
  ModelConfig c;
  c.family = family;
  c.vocab_size = 64;
  c.dim = 64;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;  // grouped k/v heads: the explicit path repeats and sums them
  c.ffn_hidden = 96;
  c.seq_len = 32;
  if (family == ModelFamily::kQwen3 || family == ModelFamily::kQwen3Moe) c.explicit_head_dim = 32;  // q width 128 != dim
  if (c.is_moe()) {
    // 4 experts of 48, top 2 (64 tokens: every expert gets some); qwen2_moe
    // renormalises (qwen3_moe does not) and has a shared expert of 80.
    c.moe.num_experts = 4;
    c.moe.num_experts_per_tok = 2;
    c.moe.moe_intermediate_size = 48;
    c.moe.norm_topk_prob = family != ModelFamily::kQwen3Moe;
    if (family == ModelFamily::kQwen2Moe) c.moe.shared_expert_intermediate_size = 80;
  }
  return c;
}

const char* family_label(ModelFamily f) { return model_family_name(f); }

// Every family: the dense ones and the mixtures of experts.
const ModelFamily kFamilies[] = {ModelFamily::kLlama,   ModelFamily::kQwen2,    ModelFamily::kQwen3,
                                 ModelFamily::kMixtral, ModelFamily::kQwen2Moe, ModelFamily::kQwen3Moe};

// Layer 0's weights in `dtype`, from init_block with every weight perturbed
// (norm weights start at ones, biases at zeros: their gradients' paths would
// go untested).
std::vector<at::Tensor> layer_weights(const Model& model, at::ScalarType dtype, at::Tensor* flat_out) {
  StateLayout layout(model.layout_specs(), 1);
  const BlockLayout& bl = layout.block(1);
  at::Tensor flat = at::zeros({bl.padded_numel});
  init_block(bl, flat, 7, 1);
  flat.narrow(0, 0, bl.numel).add_(at::randn({bl.numel}) * 0.05);
  *flat_out = flat.to(dtype);
  return param_views(bl, *flat_out);
}

struct Grads {
  at::Tensor y, dx;
  std::vector<at::Tensor> dw;
};

Grads autograd_path(const Model& model, const std::vector<at::Tensor>& w, const at::Tensor& x,
                    const at::Tensor& dy) {
  std::vector<at::Tensor> leaves;
  for (const at::Tensor& v : w) leaves.push_back(v.detach().requires_grad_(true));
  at::Tensor xin = x.detach().requires_grad_(true);
  Grads g;
  g.y = model.forward(1, leaves, xin);
  g.y.backward(dy);
  g.y = g.y.detach();
  g.dx = xin.grad();
  for (const at::Tensor& l : leaves) g.dw.push_back(l.grad());
  return g;
}

Grads explicit_path(const Model& model, const std::vector<at::Tensor>& w, const at::Tensor& x,
                    const at::Tensor& dy, LayerSaved* saved) {
  Grads g;
  g.y = model.layer_forward_saving(w, x, saved);
  g.dx = model.layer_backward(w, saved, dy, &g.dw);
  return g;
}

void expect_agrees_with_autograd(ModelFamily family, at::ScalarType dtype, double tol, at::Device dev = at::kCPU,
                                 int64_t seq_len = 0) {
  SCOPED_TRACE(std::string(family_label(family)) + (dtype == at::kFloat ? " fp32" : " bf16") + " on " + dev.str());
  at::manual_seed(3);
  ModelConfig c = family_model(family);
  if (seq_len > 0) c.seq_len = seq_len;
  Model model(c);
  at::Tensor flat;
  std::vector<at::Tensor> w = layer_weights(model, dtype, &flat);
  for (at::Tensor& t : w) t = t.to(dev);
  const at::Tensor x = at::randn({2, c.seq_len, c.dim}).to(dtype).to(dev);
  const at::Tensor dy = at::randn({2, c.seq_len, c.dim}).to(dtype).to(dev);
  const Grads ref = autograd_path(model, w, x, dy);
  LayerSaved saved;
  const Grads got = explicit_path(model, w, x, dy, &saved);
  EXPECT_LE(rel_err(got.y, ref.y), tol);
  EXPECT_LE(rel_err(got.dx, ref.dx), tol);
  ASSERT_EQ(got.dw.size(), w.size());
  StateLayout layout(model.layout_specs(), 1);
  for (size_t i = 0; i < w.size(); ++i) {
    ASSERT_TRUE(got.dw[i].defined()) << layout.block(1).params[i].spec.name;
    EXPECT_EQ(got.dw[i].sizes(), w[i].sizes()) << layout.block(1).params[i].spec.name;
    EXPECT_EQ(got.dw[i].scalar_type(), dtype) << layout.block(1).params[i].spec.name;
    EXPECT_LE(rel_err(got.dw[i], ref.dw[i]), tol) << layout.block(1).params[i].spec.name;
  }
  // The backward consumed its saved tensors.
  for (const at::Tensor& t : saved.t) EXPECT_FALSE(t.defined());
}

// fp32: the two paths differ by the attention kernel and the order of sums
// only (measured at most 3.5e-7 of the largest element; bound 1e-5); bf16: by
// about one of its ulps (2^-8) through a layer's chain of roundings (measured
// at most 6.1e-3; bound 1.5e-2). A wrong sign in rope's backward gives 0.8-1.6.
TEST(LayerOpsTest, ExplicitBackwardAgreesWithAutogradFp32) {
  for (ModelFamily f : kFamilies) {
    expect_agrees_with_autograd(f, at::kFloat, 1e-5);
  }
  expect_agrees_with_autograd(ModelFamily::kLlama, at::kFloat, 1e-5, at::kCPU, /*seq_len=*/24);
}

TEST(LayerOpsTest, ExplicitBackwardAgreesWithAutogradBf16) {
  for (ModelFamily f : kFamilies) {
    expect_agrees_with_autograd(f, at::kBFloat16, 1.5e-2);
  }
}

// run.expert_gemm grouped (at::_grouped_mm, on the CPU LibTorch's fallback)
// against the loop of GEMMs, per MoE family, fp32 and bf16: the forward, the
// input and every weight gradient, within the fp32 bound (one GEMM's
// rounding apart) and bf16's; and the grouped path against autograd too.
TEST(LayerOpsTest, GroupedExpertGemmAgreesWithTheLoop) {
  for (ModelFamily f : {ModelFamily::kMixtral, ModelFamily::kQwen2Moe, ModelFamily::kQwen3Moe}) {
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(std::string(family_label(f)) + (dtype == at::kFloat ? " fp32" : " bf16"));
      at::manual_seed(5);
      ModelConfig c = family_model(f);
      Model loop(c);
      c.moe.grouped_gemm = true;
      Model grouped(c);
      at::Tensor flat;
      const std::vector<at::Tensor> w = layer_weights(loop, dtype, &flat);
      const at::Tensor x = at::randn({2, c.seq_len, c.dim}).to(dtype);
      const at::Tensor dy = at::randn({2, c.seq_len, c.dim}).to(dtype);
      LayerSaved a, b;
      const Grads want = explicit_path(loop, w, x, dy, &a);
      const Grads got = explicit_path(grouped, w, x, dy, &b);
      const double tol = dtype == at::kFloat ? 1e-5 : 1.5e-2;
      EXPECT_LE(rel_err(got.y, want.y), tol);
      EXPECT_LE(rel_err(got.dx, want.dx), tol);
      for (size_t i = 0; i < w.size(); ++i) EXPECT_LE(rel_err(got.dw[i], want.dw[i]), tol) << i;
      const Grads ref = autograd_path(grouped, w, x, dy);
      EXPECT_LE(rel_err(got.dx, ref.dx), tol);
      for (size_t i = 0; i < w.size(); ++i) EXPECT_LE(rel_err(got.dw[i], ref.dw[i]), tol) << i;
    }
  }
  // Experts no token reaches (8 experts, top 1, 3 tokens: at least 5 empty)
  // get an exact zero gradient on both paths.
  ModelConfig c = family_model(ModelFamily::kMixtral);
  c.moe.num_experts = 8;
  c.moe.num_experts_per_tok = 1;
  c.seq_len = 3;
  Model loop(c);
  c.moe.grouped_gemm = true;
  Model grouped(c);
  at::Tensor flat;
  const std::vector<at::Tensor> w = layer_weights(loop, at::kFloat, &flat);
  const at::Tensor x = at::randn({1, 3, c.dim}), dy = at::randn({1, 3, c.dim});
  LayerSaved a, b;
  const Grads want = explicit_path(loop, w, x, dy, &a);
  const Grads got = explicit_path(grouped, w, x, dy, &b);
  int empty = 0;
  for (int64_t e = 0; e < 8; ++e) {
    const bool none = want.dw[7][e].abs().sum().item<double>() == 0.0;
    empty += none;
    if (none) {
      EXPECT_EQ(got.dw[7][e].abs().sum().item<double>(), 0.0) << "expert " << e;
      EXPECT_EQ(got.dw[8][e].abs().sum().item<double>(), 0.0) << "expert " << e;
    }
  }
  EXPECT_GE(empty, 5);
  EXPECT_LE(rel_err(got.dx, want.dx), 1e-5);
}

// On a GPU (skipped without one): the CUDA kernels called directly (flash at
// bf16, memory-efficient at fp32, whose log-sum-exp comes padded to 32
// queries) against autograd's SDPA, at 32 tokens and at 24 (not a multiple of
// 32); each entry the size its spec says. fp32 bound 1e-4: CUDA's reductions
// sum in other orders than the CPU's.
TEST(LayerOpsTest, OnAGpuTheKernelsAgreeWithAutograd) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device (or no CUDA LibTorch) on this machine";
  const at::Device gpu(at::kCUDA, 0);
  for (int64_t seq : {32, 24}) {
    for (ModelFamily f : {ModelFamily::kLlama, ModelFamily::kQwen3}) {
      expect_agrees_with_autograd(f, at::kFloat, 1e-4, gpu, seq);
      expect_agrees_with_autograd(f, at::kBFloat16, 1.5e-2, gpu, seq);
    }
  }
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    ModelConfig c = family_model(ModelFamily::kLlama);
    c.seq_len = 24;
    Model model(c);
    at::Tensor flat;
    std::vector<at::Tensor> w = layer_weights(model, dtype, &flat);
    for (at::Tensor& t : w) t = t.to(gpu);
    LayerSaved s;
    model.layer_forward_saving(w, at::randn({3, c.seq_len, c.dim}).to(dtype).to(gpu), &s);
    const int eb = dtype == at::kFloat ? 4 : 2;
    for (const SavedSpec& spec : layer_saved_specs(c)) {
      const at::Tensor& t = s[spec.id];
      ASSERT_TRUE(t.defined()) << saved_name(spec.id);
      EXPECT_EQ(int64_t(t.numel() * t.element_size()), saved_bytes(spec, 3 * c.seq_len, eb))
          << saved_name(spec.id) << (dtype == at::kFloat ? " fp32" : " bf16");
    }
  }
}

// The same backward whether the cheap entries were kept or dropped and
// recomputed, and whether every entry came from a second forward (today's
// `always`): bit for bit, bf16, every family.
TEST(LayerOpsTest, RecomputedEntriesGiveTheSameBits) {
  for (ModelFamily f : kFamilies) {
    SCOPED_TRACE(family_label(f));
    at::manual_seed(4);
    const ModelConfig c = family_model(f);
    Model model(c);
    at::Tensor flat;
    const std::vector<at::Tensor> w = layer_weights(model, at::kBFloat16, &flat);
    const at::Tensor x = at::randn({2, c.seq_len, c.dim}).to(at::kBFloat16);
    const at::Tensor dy = at::randn({2, c.seq_len, c.dim}).to(at::kBFloat16);

    LayerSaved kept;
    const Grads all = explicit_path(model, w, x, dy, &kept);

    LayerSaved cheap_dropped;
    model.layer_forward_saving(w, x, &cheap_dropped);
    int dropped = 0;
    for (const SavedSpec& s : layer_saved_specs(c)) {
      if (s.cheap) {
        cheap_dropped[s.id] = at::Tensor();
        ++dropped;
      }
    }
    // a, m (+ q and k from their projections) (+ p, the dense or shared
    // expert's SwiGLU) (+ the experts' SwiGLU)
    const bool swiglu = !c.is_moe() || c.shared_expert();
    EXPECT_EQ(dropped, 2 + (c.qk_norm() ? 2 : 0) + (swiglu ? 1 : 0) + (c.is_moe() ? 1 : 0));
    std::vector<at::Tensor> dw;
    const at::Tensor dx = model.layer_backward(w, &cheap_dropped, dy, &dw);
    EXPECT_TRUE(at::equal(dx, all.dx));
    for (size_t i = 0; i < w.size(); ++i) EXPECT_TRUE(at::equal(dw[i], all.dw[i])) << i;

    // A second forward from the saved input alone (recompute `always`):
    // every entry the forward kept, bit for bit, and no output (the down
    // projection is not run again).
    LayerSaved forward, again;
    model.layer_forward_saving(w, x, &forward);
    model.layer_recompute(w, x.clone(), &again);
    for (const SavedSpec& s : layer_saved_specs(c)) {
      ASSERT_TRUE(again[s.id].defined()) << saved_name(s.id);
      EXPECT_TRUE(at::equal(again[s.id], forward[s.id])) << saved_name(s.id);
    }
    std::vector<at::Tensor> dw2;
    EXPECT_TRUE(at::equal(model.layer_backward(w, &again, dy, &dw2), all.dx));
    for (size_t i = 0; i < w.size(); ++i) EXPECT_TRUE(at::equal(dw2[i], all.dw[i])) << i;
  }
}

// A backward missing an entry that is not cheap says which.
TEST(LayerOpsTest, MissingEntryIsNamed) {
  const ModelConfig c = family_model(ModelFamily::kLlama);
  Model model(c);
  at::Tensor flat;
  const std::vector<at::Tensor> w = layer_weights(model, at::kFloat, &flat);
  const at::Tensor x = at::randn({1, c.seq_len, c.dim});
  LayerSaved s;
  model.layer_forward_saving(w, x, &s);
  s[Saved::kGate] = at::Tensor();
  std::vector<at::Tensor> dw;
  try {
    model.layer_backward(w, &s, at::ones_like(x), &dw);
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("saved gate"), std::string::npos) << e.what();
  }
}

// Every entry's shape as the forward makes it, per token, against specs.
TEST(LayerOpsTest, SpecsGiveTheSizeOfWhatTheForwardSaves) {
  for (ModelFamily f : kFamilies) {
    SCOPED_TRACE(family_label(f));
    const ModelConfig c = family_model(f);
    Model model(c);
    at::Tensor flat;
    const std::vector<at::Tensor> w = layer_weights(model, at::kBFloat16, &flat);
    const int64_t tokens = 3 * c.seq_len;
    LayerSaved s;
    model.layer_forward_saving(w, at::randn({3, c.seq_len, c.dim}).to(at::kBFloat16), &s);
    size_t n = 0;
    for (const SavedSpec& spec : layer_saved_specs(c)) {
      ++n;
      const at::Tensor& t = s[spec.id];
      ASSERT_TRUE(t.defined()) << saved_name(spec.id);
      EXPECT_EQ(int64_t(t.numel() * t.element_size()), saved_bytes(spec, tokens, 2)) << saved_name(spec.id);
      EXPECT_EQ(t.scalar_type(), spec.fp32 ? at::kFloat : at::kBFloat16) << saved_name(spec.id);
    }
    // x, r1, a (+ qp, kp, r_q, r_k), q, k, v, o, lse, h, r2, m (+ gate, up, p)
    // (+ router logits, experts' gate_up and SwiGLU) (+ shared gate); no LoRA middles.
    const bool swiglu = !c.is_moe() || c.shared_expert();
    EXPECT_EQ(n, size_t(11 + (c.qk_norm() ? 4 : 0) + (swiglu ? 3 : 0) + (c.is_moe() ? 3 : 0) + (c.shared_expert() ? 1 : 0)));
  }
}

// Llama-3-8B's layer at bf16, per token, worked out by hand: dim 4096, ffn
// 14336, 32 heads of 128, 8 k/v heads. Of 2-byte entries: x, a, q, o, h, m
// 4096 each; k, v 1024 each; gate, up, swiglu 14336 each; 4-byte: two rstd
// of 1, the log-sum-exp of 32.
TEST(LayerOpsTest, Llama8BLayerSavesWhatWasWorkedOutByHand) {
  ModelConfig c;
  c.dim = 4096;
  c.n_layers = 32;
  c.n_heads = 32;
  c.n_kv_heads = 8;
  c.ffn_hidden = 14336;
  c.vocab_size = 128256;
  c.seq_len = 4096;
  int64_t all = 0, not_cheap = 0;
  for (const SavedSpec& s : layer_saved_specs(c)) {
    all += saved_bytes(s, 1, 2);
    if (!s.cheap) not_cheap += saved_bytes(s, 1, 2);
  }
  EXPECT_EQ(all, 6 * 4096 * 2 + 2 * 1024 * 2 + 3 * 14336 * 2 + 2 * 4 + 32 * 4);  // 139,400 B
  EXPECT_EQ(not_cheap, all - 2 * 4096 * 2 - 14336 * 2);                           // 94,344 B
}

// Note [Fused cross-entropy]: the head's fused loss and gradient against
// LibTorch's cross_entropy over an fp32 copy of the logits and autograd's
// gradient of (loss x scale), in fp32, bf16 and fp16, with ignored targets
// summed (Note [Counted tokens]) and averaged; a read-only call leaves the
// logits as they were; a target outside the vocabulary is refused.
TEST(LayerOpsTest, FusedCrossEntropyAgreesWithLibTorch) {
  at::manual_seed(3);
  const int64_t rows = 37, vocab = 1003;
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (bool masked : {false, true}) {
      const at::Tensor logits = (at::randn({rows, vocab}) * 3.0).to(dt);
      at::Tensor targets = at::randint(vocab, {rows}, at::kLong);
      if (masked) targets.index_put_({at::arange(0, rows, 4)}, -100);
      const double scale = 0.75;
      at::Tensor leaf = logits.to(at::kFloat).requires_grad_(true);
      const at::Tensor ref = masked ? at::cross_entropy_loss(leaf, targets, {}, at::Reduction::Sum, -100)
                                    : at::cross_entropy_loss(leaf, targets);
      (ref * scale).backward();
      const double denom = masked ? 1.0 : double(rows);
      std::vector<float> row_loss(static_cast<size_t>(rows));
      const at::Tensor read_only = logits.clone();
      EXPECT_NEAR(fused_cross_entropy(read_only, targets, std::nullopt, row_loss) / denom,
                  ref.item<double>(), 2e-6 * ref.item<double>());
      EXPECT_TRUE(at::equal(read_only, logits));
      const at::Tensor grad = logits.clone();
      const double sum = fused_cross_entropy(grad, targets, float(scale / denom), row_loss);
      EXPECT_NEAR(sum / denom, ref.item<double>(), 2e-6 * ref.item<double>()) << dt;
      EXPECT_EQ(grad.scalar_type(), dt);
      // LibTorch's gradient rounded to the logits' type, as its backward through the widening copy rounds it.
      const at::Tensor want = leaf.grad().to(dt).to(at::kFloat);
      const double tol = dt == at::kFloat ? 1e-6 : (dt == at::kBFloat16 ? 8e-3 : 1e-3);
      EXPECT_LT(rel_err(grad.to(at::kFloat), want), tol) << dt << (masked ? " masked" : "");
      if (masked) {
        EXPECT_EQ(grad[0].abs().max().item<double>(), 0.0);
      }
    }
  }
  std::vector<float> row_loss(2);
  EXPECT_THROW(fused_cross_entropy(at::zeros({2, 5}), at::tensor({1, 5}, at::kLong), std::nullopt, row_loss),
               InternalError);
  EXPECT_FALSE(fused_cross_entropy_applies(at::zeros({4, 6}).t()));    // rows not contiguous
  EXPECT_FALSE(fused_cross_entropy_applies(at::zeros({2, 5}, at::kDouble)));
}

}  // namespace
}  // namespace strata
