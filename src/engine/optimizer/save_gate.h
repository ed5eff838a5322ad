// The gate between the optimizer and a checkpoint save in flight: what a
// pass asks before it overwrites state a save still reads (Note [Saving
// while training] in checkpoint/checkpoint.h). The save implements it
// (engine/state_checkpoints.cc); the optimizer only calls it.
#pragma once

#include <cstdint>

namespace strata {

class SaveGate {
 public:
  virtual ~SaveGate() = default;
  // The optimizer step whose state it saves: passes of later steps wait.
  virtual int64_t applied() const = 0;
  // Until what it saves of shard offsets [begin, end) may be overwritten:
  // written, or copied into its snapshot pool (Note [Save snapshots] in
  // checkpoint/checkpoint.h). Returns the seconds it waited for the save.
  virtual double make_writable(int64_t begin, int64_t end) = 0;
};

}  // namespace strata
