#include "cli/train/saves.h"

#include <algorithm>
#include <sstream>

#include "engine/lr_schedule.h"
#include "engine/state_checkpoints.h"
#include "util/errors.h"
#include "util/logging.h"

namespace strata {

Saves::Saves(TrainSession& session) : s_(session) {
  opts_.dir = s_.cfg.run.checkpoint.dir;
  opts_.keep = s_.cfg.run.checkpoint.keep;
  opts_.engine = s_.ckpt_engine;
}

Manifest Saves::header(int64_t step, double lr) const {
  const Config& cfg = s_.cfg;
  Manifest h;
  std::ostringstream state;
  state << s_.rng;
  // The trainer adds step, optimizer_step and loss_scale.
  // After an fp16-skipped step r.lr is the next applied step's: record the
  // rate of the last step applied.
  const int64_t applied = s_.trainer->optimizer_steps();
  if (applied != step) lr = applied > 0 ? learning_rate(cfg.scheduler, cfg.optimizer.lr, applied) : 0.0;
  h.trainer = {{"scheduler", {{"type", scheduler_type_name(cfg.scheduler.type)}, {"step", applied}, {"lr", lr}}}};
  h.data = {{"rng", state.str()}, {"sequences", step * cfg.train_batch_size}, {"tokens", s_.data->num_tokens()}};
  if (cfg.data.sampling != DataSampling::kWindows) {  // Note [Example epochs] in data/dataset.h
    h.data["epoch"] = s_.examples.epoch;
    h.data["example"] = s_.examples.next;
  }
  h.config = rank_invariant_config(cfg);
  h.invariants = resume_invariants(cfg);
  return h;
}

void Saves::report(const Trainer::FinishedSave& f, nlohmann::json& line, bool in_background) const {
  if (line.contains("checkpoint_step")) {  // two finished at this step: the earlier one kept aside
    line["checkpoint_earlier"] = {{"checkpoint_step", line["checkpoint_step"]},
                                  {"checkpoint_s", line["checkpoint_s"]},
                                  {"checkpoint_write_s", line["checkpoint_write_s"]},
                                  {"checkpoint_bytes", line["checkpoint_bytes"]},
                                  {"checkpoint_snapshot_bytes", line["checkpoint_snapshot_bytes"]}};
  }
  line["checkpoint_step"] = f.step;
  line["checkpoint_s"] = f.seconds;
  line["checkpoint_write_s"] = f.write_seconds;
  line["checkpoint_bytes"] = f.bytes;
  line["checkpoint_snapshot_bytes"] = f.snapshot_bytes;
  log::info("checkpoint: step %lld saved to %s in %.3f s%s (%s from this rank, written at %s/s%s)",
            (long long)f.step, f.dir.c_str(), f.seconds, in_background ? " while training" : "",
            format_bytes(double(f.bytes)).c_str(),
            format_bytes(double(f.bytes) / std::max(f.write_seconds, 1e-9)).c_str(),
            f.snapshot_bytes > 0 ? (", " + format_bytes(double(f.snapshot_bytes)) + " of it from snapshots").c_str()
                                 : "");
}

void Saves::after_step(int64_t step, const StepResult& r, nlohmann::json& line) {
  Trainer& trainer = *s_.trainer;
  // A save in flight is published at the first step boundary where every
  // rank has written its part (one all-reduce per step while it is).
  if (trainer.checkpoint_in_flight()) {
    if (auto f = trainer.poll_checkpoint(false)) report(*f, line, true);
  }
  const int64_t every = s_.cfg.run.checkpoint.every;
  const bool due = every > 0 && step % every == 0;
  const bool last = r.stop || step == s_.cfg.run.steps;
  if (!on() || !(due || last)) return;
  if (auto f = trainer.poll_checkpoint(true)) report(*f, line, true);  // one at a time
  if (last) {
    log::info("checkpoint: saving step %lld to %s", (long long)step, opts_.dir.c_str());
    trainer.finish();  // the step's optimizer (overlapped) is not the save's time
    trainer.begin_checkpoint(opts_, header(step, r.lr));
    const Trainer::FinishedSave f = *trainer.poll_checkpoint(true);
    report(f, line, false);
  } else {
    // Periodic saves ride on training (Note [Saving while training]).
    log::info("checkpoint: saving step %lld to %s while training", (long long)step, opts_.dir.c_str());
    trainer.begin_checkpoint(opts_, header(step, r.lr));
    line["checkpoint_begun"] = step;
  }
}

void Saves::finish() {
  if (s_.trainer->checkpoint_in_flight()) s_.trainer->poll_checkpoint(true);
}

}  // namespace strata
