#include "engine/activation_checkpoints.h"

#include <algorithm>
#include <cstring>

#include "engine/compute_stream.h"
#include "util/errors.h"
#include "util/logging.h"
#include "util/trace.h"

namespace strata {

ActivationCheckpoints::ActivationCheckpoints(const PlacementPlan& plan, size_t num_blocks, TieredState* state,
                                             const std::vector<StepOp>& schedule)
    : head_(num_blocks - 1),
      accum_(std::max<int64_t>(plan.step.accum, 1)),
      held_(plan.step.held_micro),
      saved_(num_blocks * size_t(accum_)),
      host_offset_(saved_.size(), -1),
      lent_offset_(saved_.size(), -1),
      commit_wait_(saved_.size(), -1),
      pack_bytes_(host_offset_.size(), 0),
      packed_(host_offset_.size()),
      dev_(state->device()),
      state_(state) {
  // The host slots, pack by pack, as staging_needs counted them
  // (ActivationPlan::host_pack_bytes): under layer one per pack, under
  // micro_batch one per layer, of its largest pack, for its micro-batches in turn.
  const ActivationPlan& a = plan.activations;
  STRATA_CHECK(a.checkpoint_layers == int64_t(num_blocks) - 2 && a.micro == accum_,
               "the plan's layers and micro-batches are not the model's and the step's");
  int64_t host_bytes = 0;
  for (size_t b = 1; b < head_; ++b) {
    const int64_t l = int64_t(b) - 1;
    for (int64_t m = 0; m < accum_; ++m) {
      pack_bytes_[key(b, m)] = a.saved_bytes(l, m);
      if (a.lent(l, m)) lent_offset_[key(b, m)] = a.lent_offset(l, m);
      if (!a.on_host(l, m)) continue;
      host_offset_[key(b, m)] = host_bytes;
      if (held_ > 1) host_bytes += pack_bytes_[key(b, m)];
    }
    if (held_ <= 1) host_bytes += a.host_slot_bytes(l);
  }
  slot_bytes_ = a.largest_host_pack();
  if (a.lent_packs > 0) {
    const int64_t eb = plan.state.elem_bytes[size_t(Category::kGrad)];
    lent_ = state->resident_on_device(Category::kGrad, 0, (a.lent_packs * a.lend_stride + eb - 1) / eb);
    STRATA_CHECK(lent_, "the gradient homes lent to activations are not resident on the device");
    const std::vector<PlacementUnit> pieces = pipeline_pieces(plan);
    for (size_t k = 0; k < lent_offset_.size(); ++k) {
      if (lent_offset_[k] < 0) continue;
      const int64_t lo = lent_offset_[k] / eb, hi = (lent_offset_[k] + pack_bytes_[k] + eb - 1) / eb;
      for (const PlacementUnit& p : pieces) {
        if (p.offset >= hi || p.offset + p.numel <= lo || device_adam_piece(plan, p)) continue;
        commit_wait_[k] = commit_wait_[k] < 0 ? p.offset : std::min(commit_wait_[k], p.offset);
      }
    }
  }
  // A run of restores has no forward between them (micro_batch: the next
  // micro-batch's forward has not saved its packs yet, and its host slots
  // are the same). In a run, a pack from the host is brought back by the host
  // restore before it (Note [Activation copies] in plan/bound.h), the run's
  // first by the run's first restore, whatever it keeps. The packs from the
  // host take device slots 0, 1, 0, ... in each run.
  bool forward_since = true;
  int host_run = 0;
  std::vector<char> after_forward;  // per restore: a forward ran since the one before (a run begins)
  for (const StepOp& op : schedule) {
    if (op.pass == Pass::kForward) forward_since = true;
    if (op.pass != Pass::kBackward || op.block[0] == 0) continue;
    if (forward_since) host_run = 0;
    const size_t b = size_t(op.block[0]);
    slot_of_.push_back(on_host(b, op.micro) ? host_run++ % 2 : -1);
    restore_order_.emplace_back(b, op.micro);
    after_forward.push_back(forward_since ? 1 : 0);
    forward_since = false;
  }
  next_host_.assign(restore_order_.size(), -1);
  brought_.assign(restore_order_.size(), 0);
  int64_t next = -1;
  for (size_t k = restore_order_.size(); k-- > 0;) {
    next_host_[k] = next;
    next = after_forward[k] ? -1 : (slot_of_[k] >= 0 ? int64_t(k) : next);
  }
  const StagingNeeds& need = plan.staging;
  STRATA_CHECK(host_bytes == need.ckpt_host, "activation host slots differ from the plan's staging");
  if (need.ckpt_host > 0) {
    host_ = dev_.allocate_pinned(need.ckpt_host, "activations kept in host RAM");
    device_ = dev_.allocate(need.ckpt_device, "activation slots (2)");
  }
}

ActivationCheckpoints::~ActivationCheckpoints() {
  try {
    offloaded_.wait();
    dev_.synchronize(Stream::kD2H);
    dev_.synchronize(Stream::kH2D);
  } catch (...) {
    // A failed device: its error was reported by the step that failed.
  }
}

// A layer's pack is kept on the device as LibTorch tensors, or copied to the
// host (D2H) during forward and brought back (H2D) during backward, one host
// pack ahead in the schedule's backward order: while one host pack's backward
// and those of the device's and recomputed packs after it run, the next host
// pack comes into the other device slot. The copies go
// through the device layer: memcpy on the CPU device, the copy streams of a
// GPU, ordered after the compute that wrote (or last read) their source (or
// slot).
int64_t ActivationCheckpoints::record_shapes(size_t b, int64_t m, const std::vector<at::Tensor>& pack) {
  std::vector<Packed>& shapes = packed_[key(b, m)];
  shapes.clear();
  int64_t total = 0;
  for (const at::Tensor& t : pack) {
    STRATA_CHECK(t.is_non_overlapping_and_dense(), "an activation to copy is not dense");
    STRATA_CHECK(size_t(t.dim()) <= Packed::kMaxDims, "an activation to copy has too many dimensions");
    Packed& p = shapes.emplace_back();
    p.dims = size_t(t.dim());
    std::copy(t.sizes().begin(), t.sizes().end(), p.sizes.begin());
    std::copy(t.strides().begin(), t.strides().end(), p.strides.begin());
    p.dtype = t.scalar_type();
    p.bytes = int64_t(t.nbytes());
    total += int64_t(t.nbytes());
  }
  STRATA_CHECK(total == pack_bytes_[key(b, m)], strprintf("layer %zu saves %lld bytes, the plan counted %lld", b,
                                                          (long long)total, (long long)pack_bytes_[key(b, m)]));
  return total;
}

std::vector<at::Tensor> ActivationCheckpoints::rebuild(size_t b, int64_t m, std::byte* at) const {
  std::vector<at::Tensor> pack;
  for (const Packed& p : packed_[key(b, m)]) {
    pack.push_back(at::from_blob(at, at::IntArrayRef(p.sizes.data(), p.dims), at::IntArrayRef(p.strides.data(), p.dims),
                                 at::TensorOptions().dtype(p.dtype).device(torch_device(dev_))));
    at += p.bytes;
  }
  return pack;
}

void ActivationCheckpoints::save(size_t b, int64_t m, std::vector<at::Tensor> pack) {
  if (in_grad_home(b, m)) {
    // Copied on the compute stream, after the forward that made it; its own
    // memory goes back to LibTorch's allocator for that stream's later work.
    record_shapes(b, m, pack);
    DevicePtr at = lent_ + lent_offset_[key(b, m)];
    for (const at::Tensor& t : pack) {
      dev_.copy_on_device(at, DevicePtr(static_cast<std::byte*>(t.data_ptr())), int64_t(t.nbytes()), Stream::kCompute);
      at = at + int64_t(t.nbytes());
    }
    return;
  }
  if (!on_host(b, m)) {
    if (b != 0) {
      for (const at::Tensor& t : pack) device_now_ += int64_t(t.nbytes());
      peak_device_ = std::max(peak_device_, device_now_);
    }
    saved_[key(b, m)] = std::move(pack);  // the embedding's: the token ids, kept with the batch
    return;
  }
  TraceSpan span(TraceTrack::kCopy, "offload activations");
  // The previous pack's copies are done before its tensors may be freed.
  offloaded_.wait();
  const int64_t total = record_shapes(b, m, pack);
  dev_.stream_wait(Stream::kD2H, dev_.record(Stream::kCompute));
  int64_t off = 0;
  for (const at::Tensor& t : pack) {
    // A dense tensor's elements lie in nbytes from its first (all strides
    // are positive): its memory, whatever the order of its dimensions.
    dev_.copy_to_host(host_.data() + host_offset_[key(b, m)] + off, DevicePtr(static_cast<std::byte*>(t.data_ptr())),
                      int64_t(t.nbytes()), Stream::kD2H);
    off += int64_t(t.nbytes());
  }
  offloading_ = std::move(pack);
  offloaded_ = dev_.record(Stream::kD2H);
  state_->count_copy(/*to_device=*/false, total);
}

void ActivationCheckpoints::bring(size_t k) {
  TraceSpan span(TraceTrack::kCopy, "fetch activations");
  const auto [b, m] = restore_order_[k];
  brought_[k] = 1;
  if (!offloading_.empty()) {
    // The forward's last offload has landed (the packs kept on the device
    // since then did not wait for it).
    offloaded_.wait();
    offloading_.clear();
  }
  // The slot's previous pack (two host restores back) is done with it: its
  // backward is queued.
  dev_.stream_wait(Stream::kH2D, dev_.record(Stream::kCompute));
  const int slot = slot_of_[k];
  const int64_t bytes = pack_bytes_[key(b, m)];
  STRATA_CHECK(slot >= 0 && int64_t(slot) * slot_bytes_ + bytes <= device_.bytes(),
               "an activation slot the plan did not count");
  dev_.copy_to_device(device_.ptr() + int64_t(slot) * slot_bytes_, host_.data() + host_offset_[key(b, m)], bytes,
                      Stream::kH2D);
  slot_ready_[size_t(slot)] = dev_.record(Stream::kH2D);
  state_->count_copy(/*to_device=*/true, bytes);
}

std::vector<at::Tensor> ActivationCheckpoints::restore(size_t b, int64_t m) {
  if (b == 0 || restore_order_.empty()) {
    std::vector<at::Tensor> pack = std::move(saved_[key(b, m)]);
    saved_[key(b, m)].clear();
    return pack;
  }
  const size_t k = restored_++;
  STRATA_CHECK(k < restore_order_.size() && restore_order_[k] == std::make_pair(b, m),
               "activations restored out of the schedule's order");
  // The next pack from the host with no forward between, into the other
  // slot: its last user, the host pack before this one, has its backward
  // queued already.
  auto prefetch = [&](size_t n) {
    const int64_t h = next_host_[n];
    if (h >= 0 && !brought_[size_t(h)]) bring(size_t(h));
  };
  if (in_grad_home(b, m)) {
    prefetch(k);
    return rebuild(b, m, (lent_ + lent_offset_[key(b, m)]).raw());
  }
  if (!on_host(b, m)) {
    std::vector<at::Tensor> pack = std::move(saved_[key(b, m)]);
    saved_[key(b, m)].clear();
    for (const at::Tensor& t : pack) device_now_ -= int64_t(t.nbytes());
    prefetch(k);
    return pack;
  }
  if (!brought_[k]) bring(k);  // the first host pack after a forward: nothing prefetched it
  prefetch(k);
  peak_device_ = std::max(peak_device_, device_now_ + device_.bytes());
  dev_.stream_wait(Stream::kCompute, slot_ready_[size_t(slot_of_[k])]);
  return rebuild(b, m, (device_.ptr() + int64_t(slot_of_[k]) * slot_bytes_).raw());
}

}  // namespace strata
