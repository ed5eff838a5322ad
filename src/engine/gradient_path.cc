// The gradient path (Note [Gradient path] in gradient_path.h): set-up, a
// block's gradients into their homes on the device, the step's end, norms.
// Between ranks: gradient_reductions.cc; to homes off the device: the lander,
// gradient_lander.cc.
#include "engine/gradient_path.h"

#include <algorithm>

#include "cpu_adam/grad_ops.h"
#include "model/model.h"
#include "util/errors.h"
#include "util/trace.h"

#ifdef STRATA_WITH_CUDA
#include "kernels/adam.h"
#endif

namespace strata {

namespace {

at::ScalarType torch_type(cpu_adam::GradType t) {
  switch (t) {
    case cpu_adam::GradType::kBF16: return at::kBFloat16;
    case cpu_adam::GradType::kF16: return at::kHalf;
    case cpu_adam::GradType::kF32: break;
  }
  return at::kFloat;
}

}  // namespace

GradientPath::GradientPath(const StepContext& ctx, const PlacementPlan& plan)
    : ctx_(ctx), blocks_(ctx.layout->num_blocks()), final_generation_(blocks_, 0), final_device_(blocks_) {
  const StagingNeeds& need = plan.staging;
  Device& dev = *ctx.device;
  TieredState& state = *ctx.state;
  ranks_ = ctx.comm->world_size() > 1;
  reduce_scatter_ = ranks_ && ctx.cfg->zero.stage >= 2;
  sums_each_block_ = plan.step.sums_each_block();
  accum_ = ctx.cfg->gradient_accumulation_steps;
  tied_held_.resize(size_t(std::max<int64_t>(accum_, 1)));
  // Gradients come in the weights' dtype: the working copy's (ctx.param_dtype).
  const cpu_adam::GradType compute_wire = ctx.param_dtype == at::kBFloat16 ? cpu_adam::GradType::kBF16
                                          : ctx.param_dtype == at::kHalf   ? cpu_adam::GradType::kF16
                                                                             : cpu_adam::GradType::kF32;
  const int64_t ws = ctx.comm->world_size(), rank = ctx.comm->rank();
  for (size_t b = 0; b < blocks_; ++b) {
    const int64_t n = ctx.shard_numel(b);
    home_on_device_.push_back(state.resident_on_device(Category::kGrad, ctx.shard_offset[b], n) ? 1 : 0);
    wire_.push_back(grad_wire_bytes(plan, b) == 4 ? cpu_adam::GradType::kF32 : compute_wire);
    // Each rank sums the squares of its shards; with one shard but several
    // ranks (stage 0) each takes an equal part of every block, so that the
    // all-reduced sum counts every element once.
    norm_lo_.push_back(ctx.shards == 1 ? n * rank / ws : 0);
    norm_hi_.push_back(ctx.shards == 1 ? n * (rank + 1) / ws : n);
  }
  any_device_home_ = std::find(home_on_device_.begin(), home_on_device_.end(), 1) != home_on_device_.end();
  std::vector<int64_t> home_bytes;
  for (const PlacementUnit& u : plan.state.units[size_t(Category::kGrad)]) {
    home_bytes.push_back(u.numel * plan.state.elem_bytes[size_t(Category::kGrad)]);
  }
  lent_blocks_ = plan.activations.lent_blocks(home_bytes);
  for (size_t b = 0; b < lent_blocks_; ++b) STRATA_CHECK(home_on_device_[b], "a lent gradient home off the device");
  written_.assign(blocks_, 0);
  host_norms_.assign(blocks_, 0.0);
  device_norms_host_.assign(blocks_, 0.0);
  make_device_buffers(plan);
  if (need.grad_host > 0) {
    landing_ = dev.allocate_pinned(need.grad_host, "gradients on their way to host homes");
    landing_half_bytes_ = need.grad_host / 2;
  }
  lay_out_in_landing_ = dev.host_addressable();
  if (!ranks_) make_views();
  if (need.grad_rmw > 0) rmw_ = HostBuffer(size_t(need.grad_rmw), "gradient read-modify-write");
  io_registered_.push_back(state.register_io_buffer(Category::kGrad, rmw_.data(), int64_t(rmw_.bytes())));
  lander_ = std::thread([this] { lander_loop(); });
}

// The device buffers StagingNeeds counted: the gradient stages, with ranks
// the reduced shards and 16-bit copies, the sums over the micro-batches, the
// norm slots.
void GradientPath::make_device_buffers(const PlacementPlan& plan) {
  const StagingNeeds& need = plan.staging;
  Device& dev = *ctx_.device;
  if (need.grad_stage > 0) stage_[0] = dev.allocate(need.grad_stage, "gradient staging");
  if (need.grad_sync > 0) {
    // StagingNeeds::grad_sync: the second stage (none when gradients are
    // summed per step), the reduced shards, the 16-bit copies.
    if (need.grad_stage > 0) stage_[1] = dev.allocate(need.grad_stage, "gradient staging (2nd)");
    const int64_t shard_bytes = reduce_scatter_ ? 2 * plan.state.largest_block_shard_numel * 4 : 0;
    if (shard_bytes > 0) shards_mem_ = dev.allocate(shard_bytes, "reduce-scattered gradient shards");
    const int64_t comm16_bytes = need.grad_sync - need.grad_stage - shard_bytes;
    if (plan.comm.grad_bytes < 4) {
      comm_type_ = ctx_.cfg->comm.data_type == ComputeDtype::kFp16 ? at::kHalf : at::kBFloat16;
      comm16_ = dev.allocate(comm16_bytes, "gradients in communication_data_type");
      const int64_t full = plan.largest_block_numel * 2;
      for (int k = 0; k < 2; ++k) {
        for (size_t b = 0; b < blocks_; ++b) {
          comm_flat_[k].push_back(
              ctx_.device_tensor(comm16_.ptr() + k * full, ctx_.layout->block(b).padded_numel, comm_type_));
        }
        comm_shard_[k] = comm16_.ptr() + 2 * full + k * plan.state.largest_block_shard_numel * 2;
      }
    } else {
      STRATA_CHECK(comm16_bytes == 0, "16-bit gradient buffers planned for fp32 reductions");
    }
  }
  largest_shard_numel_ = plan.state.largest_block_shard_numel;
  for (int k = 0; k < 2; ++k) {
    if (!stage_[k].ptr()) continue;
    for (size_t b = 0; b < blocks_; ++b) {
      const BlockLayout& bl = ctx_.layout->block(b);
      stage_flat_[k].push_back(ctx_.device_tensor(stage_[k].ptr(), bl.padded_numel, at::kFloat));
      stage_views_[k].push_back(param_views(bl, stage_flat_[k].back()));
    }
  }
  if (need.grad_accum > 0) {
    // The whole model's sum (CommPlan::reduce_per_step), or under the
    // layer schedule one block's at a time (Note [Step schedules]).
    sum_on_device_ = !plan.comm.reduce_per_step;
    STRATA_CHECK(!sum_on_device_ || (sums_each_block_ && !ranks_), "a block gradient sum outside the layer schedule");
    sum_mem_ = dev.allocate(need.grad_accum, sum_on_device_ ? "block gradient sum" : "gradients summed over the step");
    for (size_t b = 0; b < blocks_; ++b) {
      const BlockLayout& bl = ctx_.layout->block(b);
      const int64_t at = sum_on_device_ ? 0 : bl.offset * 4;
      accum_flat_.push_back(ctx_.device_tensor(sum_mem_.ptr() + at, bl.padded_numel, at::kFloat));
      accum_views_.push_back(param_views(bl, accum_flat_.back()));
      accum_padding_.push_back(accum_flat_.back().narrow(0, bl.numel, bl.padded_numel - bl.numel));
    }
  }
  if (need.grad_norms > 0) {
    device_norms_ = dev.allocate(int64_t(blocks_) * 8, "gradient norms");
    const int64_t scratch = need.grad_norms - int64_t(blocks_) * 8;
    if (scratch > 0) norm_scratch_ = dev.allocate(scratch, "gradient norm partials");
  }
}

// One rank: per block, views of its device home, or of the buffer its
// gradient is laid out in before it lands (the stage, or on the CPU device
// each landing half) in its wire dtype.
void GradientPath::make_views() {
  home_views_.resize(blocks_);
  for (int h = 0; h < 2; ++h) {
    wire_flat_[h].resize(blocks_);
    wire_views_[h].resize(blocks_);
    wire_padding_[h].resize(blocks_);
  }
  for (size_t b = 0; b < blocks_; ++b) {
    const BlockLayout& bl = ctx_.layout->block(b);
    if (home_on_device_[b]) {
      const DevicePtr home = ctx_.state->resident_on_device(Category::kGrad, ctx_.shard_offset[b], bl.padded_numel);
      home_views_[b] = param_views(bl, ctx_.device_tensor(home, bl.padded_numel, at::kFloat));
      continue;
    }
    if (sum_on_device_) continue;  // summed in sum_mem_, landed from there
    for (int h = 0; h < (lay_out_in_landing_ ? 2 : 1); ++h) {
      const DevicePtr at = lay_out_in_landing_ ? DevicePtr(landing_.data() + h * landing_half_bytes_) : stage_[0].ptr();
      STRATA_CHECK(at, "a gradient home off the device without a stage or landing buffer");
      wire_flat_[h][b] = ctx_.device_tensor(at, bl.padded_numel, torch_type(wire_[b]));
      wire_views_[h][b] = param_views(bl, wire_flat_[h][b]);
      wire_padding_[h][b] = wire_flat_[h][b].narrow(0, bl.numel, bl.padded_numel - bl.numel);
    }
  }
}

GradientPath::~GradientPath() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    quit_ = true;
  }
  cv_.notify_all();
  lander_.join();
}

int64_t GradientPath::device_bytes() const {
  return stage_[0].bytes() + stage_[1].bytes() + shards_mem_.bytes() + comm16_.bytes() + sum_mem_.bytes() +
         device_norms_.bytes() + norm_scratch_.bytes();
}

int64_t GradientPath::host_bytes() const { return landing_.bytes() + int64_t(rmw_.bytes()); }

void GradientPath::begin_step() {
  wait_lander_idle();
  for (Reduction& r : reduction_) {
    // A failed step's reduction in flight: let it end, drop it.
    try {
      r.done.wait();
    } catch (...) {
    }
    r = Reduction();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    error_ = nullptr;
    links_ = LinkBytes();
    compute_thread_ = std::this_thread::get_id();  // the step's caller queues the compute
    ++generation_;
    cancelled_ = false;
  }
  std::fill(written_.begin(), written_.end(), 0);
  tied_ = at::Tensor();
  for (at::Tensor& t : tied_held_) t = at::Tensor();
}

bool GradientPath::wait_final(size_t b, Completion* device) {
  std::unique_lock<std::mutex> lock(mu_);
  STRATA_CHECK(b < final_generation_.size(), "a final gradient of a block out of range");
  cv_.wait(lock, [&] { return final_generation_[b] == generation_ || cancelled_; });
  if (final_generation_[b] != generation_) return false;
  *device = final_device_[b];
  return true;
}

void GradientPath::cancel_waits() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_ = true;
  }
  cv_.notify_all();
}

void GradientPath::mark_final(size_t b, const Completion& device) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    mark_final_locked(b, device);
  }
  cv_.notify_all();
}

void GradientPath::mark_final_locked(size_t b, const Completion& device) {
  final_generation_[b] = generation_;
  final_device_[b] = device;
}

void GradientPath::set_tied(int64_t micro, const at::Tensor& g) {
  STRATA_CHECK(micro >= 0 && micro < int64_t(tied_held_.size()), "a tied gradient for a micro-batch out of range");
  tied_held_[size_t(micro)] = g;
}

void GradientPath::add(size_t b, const std::vector<at::Tensor>& grads, size_t first, int64_t micro) {
  first_micro_ = micro == 0;
  last_micro_ = micro + 1 == accum_;
  if (first_micro_ && b < lent_blocks_) {
    // Its home held activation packs since the step began, all restored by
    // now: padding included, it starts again from zero (on the compute
    // stream, after the backwards that read them).
    const int64_t n = ctx_.shard_numel(b);
    ctx_.device->fill_on_device(ctx_.state->resident_on_device(Category::kGrad, ctx_.shard_offset[b], n), 0,
                                n * ctx_.state->elem_bytes(Category::kGrad), Stream::kCompute);
  }
  // The head's share of the tied embedding for this micro-batch.
  if (b == ctx_.embedding_block) tied_ = std::move(tied_held_[size_t(micro)]);
  if (ranks_) {
    add_to_reduce(b, grads, first);
  } else if (home_on_device_[b]) {
    add_on_device(b, grads, first);
  } else if (sum_on_device_) {
    add_summed(b, grads, first);
  } else {
    add_through_host(b, grads, first);
  }
  tied_ = at::Tensor();
}

void GradientPath::end_micro() {
  if (!ranks_) return;
  // The last reductions, oldest first.
  const int oldest = seq_[0] < seq_[1] ? 0 : 1;
  complete_reduction(oldest);
  complete_reduction(1 - oldest);
}

double GradientPath::finish_step(LinkBytes* moved) {
  wait_lander_idle();
  {
    std::lock_guard<std::mutex> lock(mu_);
    *moved += links_;
    links_ = LinkBytes();
    if (error_) {
      std::exception_ptr e = error_;
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }
  if (any_device_home_) {
    // One copy of every block's norm slot, after the kernels that wrote them.
    Device& dev = *ctx_.device;
    dev.stream_wait(Stream::kD2H, dev.record(Stream::kCompute));
    dev.copy_to_host(device_norms_host_.data(), device_norms_.ptr(), int64_t(blocks_) * 8, Stream::kD2H);
    dev.record(Stream::kD2H).wait();
  }
  double sum = 0.0;
  for (size_t b = 0; b < blocks_; ++b) sum += home_on_device_[b] ? device_norms_host_[b] : host_norms_[b];
  return sum;
}

GradientPath::LanderStats GradientPath::lander_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

// ---- one rank ---------------------------------------------------------------------

// A device home: each parameter's gradient added into it in place (copied on
// the block's first micro-batch), on the compute stream.
void GradientPath::add_on_device(size_t b, const std::vector<at::Tensor>& grads, size_t first) {
  const bool write = !written_[b];
  const std::vector<at::Tensor>& home = home_views_[b];
  write_or_add(home, b, grads, first, write);
  written_[b] = 1;
  if (last_micro_) {
    device_norm(b, ctx_.state->resident_on_device(Category::kGrad, ctx_.shard_offset[b], ctx_.shard_numel(b)));
    if (track_finals_) mark_final(b, ctx_.device->record(Stream::kCompute));
  }
}

// dst = G (`write`) or dst + G, parameter by parameter (undefined: zero, or
// nothing to add), where G is autograd's gradient or, for the tied
// embedding, the real fp32 sum with the head's share, made in the stage
// (the head's share first, as autograd would sum them).
void GradientPath::write_or_add(const std::vector<at::Tensor>& dst, size_t b, const std::vector<at::Tensor>& grads,
                                size_t first, bool write) {
  for (size_t i = 0; i < dst.size(); ++i) {
    at::Tensor g = first + i < grads.size() ? grads[first + i] : at::Tensor();
    if (i == 0 && b == ctx_.embedding_block && tied_.defined()) {
      stage_free();
      const at::Tensor& sum = stage_views_[0][b][0];
      sum.copy_(tied_);
      if (g.defined()) sum.add_(g);
      tied_ = at::Tensor();
      g = sum;
    }
    if (!g.defined()) {
      if (write) dst[i].zero_();
    } else if (write) {
      dst[i].copy_(g);
    } else {
      dst[i].add_(g);
    }
  }
}

// A home off the device: the gradient laid out in the stage in its wire
// dtype (padding zeroed), copied D2H, added by the lander. On a
// host-addressable device it is laid out in a landing half directly.
void GradientPath::add_through_host(size_t b, const std::vector<at::Tensor>& grads, size_t first) {
  int half = 0;
  if (lay_out_in_landing_) {
    half = claim_landing();
  } else {
    stage_free();
  }
  try {
    lay_out(b, grads, first, half);
  } catch (...) {
    if (lay_out_in_landing_) release_landing(half);  // nothing was queued on it
    throw;
  }
  const BlockLayout& bl = ctx_.layout->block(b);
  if (lay_out_in_landing_) {
    ctx_.state->count_copy(/*to_device=*/false, bl.padded_numel * bytes_of(wire_[b]));  // what a GPU would copy
    queue_landing(b, half, wire_[b], Completion(), last_micro_);
  } else {
    land(b, DevicePtr(static_cast<std::byte*>(wire_flat_[half][b].data_ptr())), wire_[b], last_micro_);
  }
}

// Under the layer schedule with A > 1 (Note [Step schedules]): the block's
// micro-batch gradients G (the tied embedding's the fp32 sum with the head's
// share, in the stage) summed in fp32 on the device in the order 0..A-1 —
// G on the first, + G on the others: the IEEE additions the home would make
// — and landed once, in fp32, as the home's first write (no read on NVMe).
void GradientPath::add_summed(size_t b, const std::vector<at::Tensor>& grads, size_t first) {
  if (first_micro_) stage_free();  // the last landing's D2H has read the sum
  write_or_add(accum_views_[b], b, grads, first, first_micro_);
  if (first_micro_ && accum_padding_[b].numel() > 0) accum_padding_[b].zero_();
  if (!last_micro_) return;
  land(b, DevicePtr(static_cast<std::byte*>(accum_flat_[b].data_ptr())), cpu_adam::GradType::kF32, true);
}

// Block b's gradient in its wire dtype in buffer `half`, padding zeroed.
void GradientPath::lay_out(size_t b, const std::vector<at::Tensor>& grads, size_t first, int half) {
  const std::vector<at::Tensor>& dst = wire_views_[half][b];
  for (size_t i = 0; i < dst.size(); ++i) {
    const at::Tensor g = first + i < grads.size() ? grads[first + i] : at::Tensor();
    if (i == 0 && b == ctx_.embedding_block && tied_.defined()) {
      dst[0].copy_(tied_);  // fp32: the head's share first
      tied_ = at::Tensor();
      if (g.defined()) dst[0].add_(g);
    } else if (g.defined()) {
      dst[i].copy_(g);
    } else {
      dst[i].zero_();
    }
  }
  if (wire_padding_[half][b].numel() > 0) wire_padding_[half][b].zero_();
}

// ---- norms ------------------------------------------------------------------------

void GradientPath::device_norm(size_t b, DevicePtr home) {
  STRATA_CHECK(home && device_norms_.ptr(), "a device norm without a device home or norm slots");
  const float* x = reinterpret_cast<const float*>((home + norm_lo_[b] * 4).raw());
  const int64_t count = norm_hi_[b] - norm_lo_[b];
  double* out = reinterpret_cast<double*>((device_norms_.ptr() + int64_t(b) * 8).raw());
#ifdef STRATA_WITH_CUDA
  if (ctx_.device->is_cuda()) {
    ctx_.device->make_current();
    kernels::ordered_squared_norm(x, count, out, reinterpret_cast<double*>(norm_scratch_.ptr().raw()),
                                  ctx_.device->native_stream(Stream::kCompute));
    return;
  }
#endif
  // The CPU device, or a test device whose compute stream runs at once: the
  // CPU reference is its kernel (kernels_test checks CUDA's bit for bit).
  STRATA_CHECK(!ctx_.device->is_cuda(), "a CUDA device in a build without the CUDA path");
  *out = cpu_adam::ordered_squared_norm(x, count);
}

}  // namespace strata
