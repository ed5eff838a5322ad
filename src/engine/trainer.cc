#include "engine/trainer.h"

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>

#include "engine/lr_schedule.h"
#include "util/errors.h"

namespace strata {

namespace {

at::ScalarType dtype_of(const std::string& name) {
  if (name == "bf16") return at::kBFloat16;
  if (name == "fp16") return at::kHalf;
  return at::kFloat;
}

at::Tensor wrap(const HostBuffer& buf, int64_t numel, at::ScalarType dtype) {
  return at::from_blob(buf.data(), {numel}, at::TensorOptions().dtype(dtype));
}

// Leaf copies of weight views that autograd can differentiate with respect to;
// they share storage with the views.
std::vector<at::Tensor> as_leaves(const std::vector<at::Tensor>& views) {
  std::vector<at::Tensor> leaves;
  leaves.reserve(views.size());
  for (const at::Tensor& v : views) leaves.push_back(v.detach().requires_grad_(true));
  return leaves;
}

}  // namespace

Trainer::Trainer(const Config& cfg, const Model& model)
    : cfg_(cfg), model_(model), layout_(model.layout_specs(), cfg.world_size),
      compute_dtype_(dtype_of(cfg.run.compute_dtype)) {
  if (compute_dtype_ == at::kHalf) {
    throw ConfigError("fp16.enabled", "fp16 compute (with loss scaling) is not supported yet; use bf16");
  }
  const int64_t n = layout_.total_numel();
  const size_t f32 = sizeof(float) * size_t(n);
  master_buf_ = HostBuffer(f32, "master weights (fp32)");
  grad_buf_ = HostBuffer(f32, "gradients (fp32)");
  exp_avg_buf_ = HostBuffer(f32, "Adam exp_avg (fp32)");
  exp_avg_sq_buf_ = HostBuffer(f32, "Adam exp_avg_sq (fp32)");
  master_ = wrap(master_buf_, n, at::kFloat);
  grad_ = wrap(grad_buf_, n, at::kFloat);
  exp_avg_ = wrap(exp_avg_buf_, n, at::kFloat);
  exp_avg_sq_ = wrap(exp_avg_sq_buf_, n, at::kFloat);
  if (compute_dtype_ != at::kFloat) {
    param16_buf_ = HostBuffer(2 * size_t(n), "working parameters (16-bit)");
    param16_ = wrap(param16_buf_, n, compute_dtype_);
  }
  for (size_t b = 0; b < model_.num_blocks(); ++b) {
    if (model_.blocks()[b].kind == BlockKind::kEmbedding) embedding_block_ = b;
    if (model_.blocks()[b].kind == BlockKind::kHead) head_block_ = b;
  }
  // One generator, blocks initialised in model order: the same seed gives the
  // same weights whatever the placement or world size.
  at::Generator gen = at::detail::createCPUGenerator(cfg.run.seed);
  for (size_t b = 0; b < layout_.num_blocks(); ++b) {
    init_block(layout_.block(b), block_range(master_, b), gen);
  }
  sync_working_copy();
  saved_inputs_.resize(layout_.num_blocks());

  const cpu_adam::Isa isa = cpu_adam::parse_isa(cfg.run.cpu_adam_isa);
  if (!cpu_adam::isa_supported(isa)) {
    throw ConfigError("run.cpu_adam_isa", std::string(cpu_adam::isa_name(isa)) +
                                              " is not supported by this CPU (best: " +
                                              cpu_adam::isa_name(cpu_adam::best_isa()) + ")");
  }
  adam_ = std::make_unique<cpu_adam::CpuAdam>(int(cfg.run.threads), isa);
}

StateBytes Trainer::state_bytes() const {
  const int64_t n = layout_.total_numel();
  StateBytes s;
  s.master = 4 * n;
  s.grad = 4 * n;
  s.optimizer = 8 * n;
  s.param16 = compute_dtype_ == at::kFloat ? 0 : 2 * n;
  return s;
}

at::Tensor Trainer::block_range(const at::Tensor& flat, size_t b) const {
  const BlockLayout& bl = layout_.block(b);
  return flat.narrow(0, bl.offset, bl.padded_numel);
}

std::vector<at::Tensor> Trainer::block_weights(size_t b) const {
  const at::Tensor& working = compute_dtype_ == at::kFloat ? master_ : param16_;
  return param_views(layout_.block(b), block_range(working, b));
}

void Trainer::sync_working_copy() {
  if (compute_dtype_ != at::kFloat) param16_.copy_(master_);
}

void Trainer::accumulate_grad(size_t b, const std::vector<at::Tensor>& grads, size_t first) {
  std::vector<at::Tensor> dst = param_views(layout_.block(b), block_range(grad_, b));
  for (size_t i = 0; i < dst.size(); ++i) {
    const at::Tensor& g = grads[first + i];
    if (g.defined()) dst[i].add_(g);  // fp32 accumulation of 16-bit gradients
  }
}

at::Tensor Trainer::loss_of(const at::Tensor& logits, const at::Tensor& targets) const {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat),
                                targets.reshape({-1}));
}

// Note [Step order]
// Forward runs every block but the head without autograd and keeps each
// block's input (the activation checkpoint). The head runs with autograd, so
// the loss gives d(loss)/d(head input). Backward then walks the blocks in
// reverse: recompute the block from its saved input with autograd over leaf
// views of its weights, and ask autograd for the gradients of the input and of
// the weights given the output gradient. Weight gradients are added into the
// block's range of the flat fp32 gradient buffer, so nothing but one block's
// graph is alive at a time. A tied head adds its output-projection gradient
// into the embedding block's range, which backward reaches last.
double Trainer::forward_backward(const at::Tensor& tokens, double loss_scale) {
  const int64_t T = cfg_.model.seq_len;
  at::Tensor inputs = tokens.narrow(1, 0, T);
  at::Tensor targets = tokens.narrow(1, 1, T);
  const size_t nb = layout_.num_blocks();

  at::Tensor x = inputs;
  {
    at::NoGradGuard no_grad;
    for (size_t b = 0; b < head_block_; ++b) {
      saved_inputs_[b] = x;
      x = model_.forward(b, block_weights(b), x);
    }
  }
  STRATA_CHECK(head_block_ == nb - 1, "the head must be the last block");

  // Head and loss, with autograd.
  at::Tensor dx;
  double loss_value = 0.0;
  {
    at::Tensor xin = x.detach().requires_grad_(true);
    std::vector<at::Tensor> w = as_leaves(block_weights(head_block_));
    at::Tensor tied;
    if (cfg_.model.tie_embeddings) tied = as_leaves(block_weights(embedding_block_))[0];
    at::Tensor loss = loss_of(model_.forward(head_block_, w, xin, tied), targets);
    loss_value = loss.item<double>();
    std::vector<at::Tensor> wrt{xin};
    wrt.insert(wrt.end(), w.begin(), w.end());
    if (tied.defined()) wrt.push_back(tied);
    std::vector<at::Tensor> grads =
        torch::autograd::grad({loss * loss_scale}, wrt, /*grad_outputs=*/{}, /*retain_graph=*/false);
    dx = grads[0];
    accumulate_grad(head_block_, grads, 1);
    if (tied.defined()) {
      const BlockLayout& emb = layout_.block(embedding_block_);
      at::Tensor dst = param_views(emb, block_range(grad_, embedding_block_))[0];
      dst.add_(grads.back());
    }
  }

  // Layers and embedding, in reverse, recomputed from their saved inputs.
  for (size_t b = head_block_; b-- > 0;) {
    std::vector<at::Tensor> w = as_leaves(block_weights(b));
    const bool is_embedding = model_.blocks()[b].kind == BlockKind::kEmbedding;
    at::Tensor xin = is_embedding ? saved_inputs_[b] : saved_inputs_[b].detach().requires_grad_(true);
    at::Tensor y = model_.forward(b, w, xin);
    std::vector<at::Tensor> wrt;
    if (!is_embedding) wrt.push_back(xin);
    wrt.insert(wrt.end(), w.begin(), w.end());
    std::vector<at::Tensor> grads = torch::autograd::grad({y}, wrt, {dx}, /*retain_graph=*/false);
    accumulate_grad(b, grads, is_embedding ? 0 : 1);
    if (!is_embedding) dx = grads[0];
    saved_inputs_[b] = at::Tensor();
  }
  return loss_value;
}

StepResult Trainer::step(const int64_t* tokens) {
  const int64_t accum = cfg_.gradient_accumulation_steps;
  const int64_t micro = cfg_.train_micro_batch_size_per_gpu;
  const int64_t window = cfg_.model.seq_len + 1;
  grad_.zero_();
  StepResult r;
  for (int64_t m = 0; m < accum; ++m) {
    at::Tensor batch = at::from_blob(const_cast<int64_t*>(tokens + m * micro * window),
                                     {micro, window}, at::TensorOptions().dtype(at::kLong));
    r.loss += forward_backward(batch, 1.0 / double(accum)) / double(accum);
  }
  r.tokens = accum * micro * cfg_.model.seq_len;

  // Global-norm clipping folded into the optimizer as a gradient scale, with
  // torch.nn.utils.clip_grad_norm_'s formula.
  r.grad_norm = grad_.norm().item<double>();
  float grad_scale = 1.0f;
  if (cfg_.gradient_clipping > 0.0) {
    const double coef = cfg_.gradient_clipping / (r.grad_norm + 1e-6);
    if (coef < 1.0) grad_scale = float(coef);
  }

  ++step_;
  r.lr = learning_rate(cfg_.scheduler, cfg_.optimizer.lr, step_);
  cpu_adam::AdamParams h;
  h.lr = r.lr;
  h.beta1 = cfg_.optimizer.beta1;
  h.beta2 = cfg_.optimizer.beta2;
  h.eps = cfg_.optimizer.eps;
  h.weight_decay = cfg_.optimizer.weight_decay;
  h.adamw = cfg_.optimizer.adam_w_mode;
  cpu_adam::AdamSpans spans;
  spans.param = master_.data_ptr<float>();
  spans.grad = grad_.data_ptr<float>();
  spans.grad_type = cpu_adam::GradType::kF32;
  spans.exp_avg = exp_avg_.data_ptr<float>();
  spans.exp_avg_sq = exp_avg_sq_.data_ptr<float>();
  spans.numel = layout_.total_numel();
  if (compute_dtype_ == at::kBFloat16) {
    // The 16-bit working copy comes out of the same pass over the fp32 state.
    spans.emit = param16_.data_ptr();
    spans.emit_type = cpu_adam::EmitType::kBF16;
  }
  adam_->step(h, cpu_adam::StepArgs{step_, grad_scale}, spans);
  return r;
}

double Trainer::eval_loss(const int64_t* tokens, int64_t batches) {
  at::NoGradGuard no_grad;
  const int64_t micro = cfg_.train_micro_batch_size_per_gpu;
  const int64_t window = cfg_.model.seq_len + 1;
  const int64_t T = cfg_.model.seq_len;
  double total = 0.0;
  for (int64_t i = 0; i < batches; ++i) {
    at::Tensor batch = at::from_blob(const_cast<int64_t*>(tokens + i * micro * window),
                                     {micro, window}, at::TensorOptions().dtype(at::kLong));
    at::Tensor x = batch.narrow(1, 0, T);
    for (size_t b = 0; b < head_block_; ++b) x = model_.forward(b, block_weights(b), x);
    at::Tensor tied;
    if (cfg_.model.tie_embeddings) tied = block_weights(embedding_block_)[0];
    at::Tensor logits = model_.forward(head_block_, block_weights(head_block_), x, tied);
    total += loss_of(logits, batch.narrow(1, 1, T)).item<double>();
  }
  return total / double(batches);
}

}  // namespace strata
