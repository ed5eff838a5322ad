// `strata train`'s set-up: everything between the command line and the first
// step — the config, the ranks meeting, the device, the rates of the step's
// bound, the fit verdict, the checkpoint directory's checks, the data, the
// model, the trainer (resumed where asked), the monitors and the start-up
// report. Everything that can fail on bad input fails here, before the first
// byte of output is written. The loop itself is run_train (cli/train.cc).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cli/monitors.h"
#include "cli/train/metrics.h"
#include "comm/communicator.h"
#include "config/config.h"
#include "data/dataset.h"
#include "engine/trainer.h"
#include "plan/planner.h"
#include "memory/device.h"
#include "model/model.h"
#include "nvme/engine.h"
#include "util/trace.h"

namespace strata {

struct TrainOptions {
  std::string config_path;
  std::vector<std::string> overrides;
  int64_t steps = 0;        // 0 = from config
  std::string metrics;      // empty = from config
  std::string trace;        // Chrome trace file; empty = no trace
  bool resume = false;      // --resume [DIR]
  std::string resume_dir;   // empty = run.checkpoint.dir
  bool reprobe = false;     // measure the bound's rates again (Note [Kept rates] in engine/probes.h)
};

// What each step's bound_s is computed from: the plan's work (its link and
// network counts replaced by each step's own) and the rates.
struct TrainBound {
  StepWork work;
  Rates rates;
  bool cpu_compute = true;
};

// Uninstalls the process's tracer when the session ends (declared after the
// tracer and before the trainer, whose optimizer thread records into it
// until the trainer is gone, also when a step throws).
struct TracerUninstall {
  ~TracerUninstall() { Tracer::install(nullptr); }
};

// One training run's objects. The members are made in this order and
// destroyed in the reverse one: the trainer goes before what it refers to.
// Lives on the heap (open_session) and is never moved: the trainer and the
// loop hold references to its members.
struct TrainSession {
  RankInfo who;
  Config cfg;
  std::string trace_path;  // this rank's, "" for none
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<Device> own_device;
  Device* device = nullptr;  // own_device, or the CPU
  std::unique_ptr<TokenDataset> data;
  std::unique_ptr<Model> model;
  std::unique_ptr<Tracer> tracer;
  TracerUninstall uninstall;
  nvme::EngineOptions ckpt_engine;  // checkpoint files' I/O
  std::unique_ptr<Trainer> trainer;
  std::mt19937_64 rng;     // the training windows' draws (saved in checkpoints)
  ExampleCursor examples;  // data.sampling examples / packed: the epoch and place (saved in checkpoints)
  int64_t first_step = 1;  // after a resume, the checkpoint's step + 1
  std::unique_ptr<Monitors> monitors;
  std::unique_ptr<MetricsWriter> metrics;
  std::array<int64_t, kNumTiers> peak{};  // the plan's peak bytes per tier
  TrainBound bound;
};

// Sets a run up and reports it (the start-up lines); throws on bad input
// with one line naming the key or file.
std::unique_ptr<TrainSession> open_session(const TrainOptions& opt);

}  // namespace strata
