// CPU Adam/AdamW over flat spans (fp32 master weights, fp32 or bf16 moments),
// with the gradient scale folded in and an optional 16-bit copy of the
// updated parameters written in the same pass.
// Leaf library: no LibTorch, no other Strata module.
#pragma once

#include <oneapi/tbb/task_arena.h>

#include <cstdint>
#include <memory>

#include "cpu_adam/convert.h"
#include "cpu_adam/types.h"

namespace strata::cpu_adam {

// The formula, its rounding and the non-finite report: Note [AdamW numerics]
// and Note [Non-finite gradients] in types.h; the 16-bit copy: Note [16-bit
// rounding] in convert.h and Note [Streaming the 16-bit copy] in kernel_simd.h.

// Runs Adam steps on a private oneTBB arena of `threads` threads.
// Thread-safety: one step()/convert() at a time per object (the arena is
// shared by the calls); distinct objects are independent.
// Nothing is allocated per call: spans are caller-owned, the arena and its
// threads are created in the constructor (oneTBB recycles its task memory).
class CpuAdam {
 public:
  // threads: 0 = all cores (oneTBB's default concurrency). The calling thread
  // is one of them. REQUIRES: isa_supported(isa); throws std::invalid_argument
  // otherwise.
  explicit CpuAdam(int threads = 0, Isa isa = best_isa());
  CpuAdam(const CpuAdam&) = delete;
  CpuAdam& operator=(const CpuAdam&) = delete;

  int threads() const { return threads_; }
  Isa isa() const { return isa_; }

  // One Adam step over the spans (Note [AdamW numerics]). Returns true when
  // every scaled gradient was finite (Note [Non-finite gradients]).
  // REQUIRES: args.step >= 1; param, exp_avg, exp_avg_sq and grad non-null
  // and not overlapping each other when numel > 0 (emit may not overlap them
  // either); emit non-null iff emit_type != kNone. Any alignment is accepted.
  bool step(const AdamParams& params, const StepArgs& args, const AdamSpans& spans);

  // Note [A step that keeps its state]
  // The same step as step(), bit for bit, computed tile by tile in scratch
  // memory of the thread that runs the tile: spans.param, exp_avg and
  // exp_avg_sq are read and left as they were, and only the updated
  // parameters come out: in emit_type into spans.emit, or (emit_type kNone)
  // in fp32 into `param_out`. The optimizer's speculative update (Note
  // [Speculative optimizer] in src/engine/optimizer/optimizer_pass.h) emits the
  // working copy this way and writes the state once the step's verdict is
  // known. Main-memory traffic: the step's reads and the 16-bit (or fp32)
  // copy's writes; the scratch, kTileNumel elements of each of the three per
  // thread, stays in the core's caches.
  // REQUIRES: as step(); param_out non-null iff emit_type == kNone, not
  // overlapping the other spans.
  bool step_keeping_state(const AdamParams& params, const StepArgs& args, const AdamSpans& spans,
                          float* param_out);

  // dst[i] = src[i] rounded to `type` (convert.h), in parallel on the arena:
  // the separate 16-bit pass that step() with emit makes unnecessary.
  // REQUIRES: type != kNone; src and dst do not overlap.
  void convert(const float* src, void* dst, EmitType type, int64_t numel);

  // body(context, b, e) over disjoint [b, e) covering [0, n) on the arena
  // (the calling thread is one of its threads), for other work the caller
  // spreads over Adam's threads (the swap checksums of the optimizer's
  // pipeline, Note [Parallel checksums] in nvme/swap_store.h). `body` must
  // not throw. One call at a time per object, as for step().
  void parallel_for(int64_t n, void (*body)(void* context, int64_t begin, int64_t end), void* context);

  // Elements per parallel tile: large enough to amortise scheduling and keep
  // the hardware prefetchers streaming, small enough to balance two threads.
  static constexpr int64_t kTileNumel = 16384;  // 64 KiB of each fp32 array

 private:
  // Tiles [tile_begin, tile_end) of step_keeping_state, in scratch slot `slot`.
  bool keep_state_tiles(const void* constants, const AdamSpans& s, float* param_out, int64_t tile_begin,
                        int64_t tile_end, int slot);

  int threads_;
  Isa isa_;
  tbb::task_arena arena_;
  // step_keeping_state's scratch: per arena slot, kTileNumel fp32 elements
  // of param, exp_avg and exp_avg_sq (allocated here, once).
  std::unique_ptr<float[]> scratch_;
};

// Single-threaded conversion with the kernels of `isa` (best by default).
// REQUIRES: type != kNone; isa_supported(isa).
void convert_f32_to_16(const float* src, void* dst, EmitType type, int64_t numel,
                       Isa isa = best_isa());

}  // namespace strata::cpu_adam
