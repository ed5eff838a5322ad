// One rank of a multi-process test (ranks_test.cc starts several under
// `strata launch`): trains as `strata train` does and writes what the tests
// compare. Usage: rank_worker CONFIG OUT_PREFIX [KEY=VALUE ...]
//   OUT.losses       rank 0: every step's global loss, %.17g, one per line
//   OUT.tensors      rank 0: "block name numel" per parameter, in order
//   OUT.master       rank 0: the gathered, unpadded fp32 master weights
//   OUT.exp_avg, OUT.exp_avg_sq   rank 0: the gathered, unpadded moments as stored
//   OUT.frozen       rank 0, with a frozen space (LoRA): the gathered, unpadded
//                    frozen values in the compute dtype
//   OUT.rank<r>.steps every rank: "step N" after each step (flushed)
//   OUT.rank<r>.json every rank: bytes allocated per category, shard numel,
//                    per step bytes on each link and on the network
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <ATen/Parallel.h>

#include "comm/communicator.h"
#include "config/config.h"
#include "data/dataset.h"
#include "deferred_collectives.h"
#include "engine/trainer.h"
#include "model/model.h"
#include "util/errors.h"
#include "util/logging.h"

using namespace strata;

namespace {

void write_unpadded(Trainer& t, Category c, const std::string& path, bool write) {
  std::ofstream out;
  if (write) out.open(path, std::ios::binary);
  for (size_t b = 0; b < t.layout().num_blocks(); ++b) {
    at::Tensor full = t.state_block(c, b);  // collective
    const BlockLayout& bl = t.layout().block(b);
    const int64_t n = c == Category::kFrozen ? bl.frozen_numel : bl.numel;
    if (write) out.write(static_cast<const char*>(full.data_ptr()), std::streamsize(n * full.element_size()));
  }
}

int run(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: rank_worker CONFIG OUT_PREFIX [--device=deferred|deferred-stream] [KEY=VALUE ...]\n");
    return 2;
  }
  const RankInfo who = rank_info_from_environment();
  std::vector<std::string> overrides;
  std::string device_kind;
  for (int i = 3; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--device=", 0) == 0) {
      device_kind = a.substr(9);
    } else {
      overrides.push_back(a);
    }
  }
  Config cfg = load_config(argv[1], overrides, who.world_size);
  setup_logging(cfg.run.log_level, "", who.world_size > 1 ? who.rank : -1);
  at::set_num_threads(1);
  const std::string out = argv[2];
  CommOptions co;
  co.timeout_s = cfg.comm.timeout_s;
  std::unique_ptr<Communicator> comm = make_communicator(who, co);
  Model model(cfg.model);
  TokenDataset data(cfg.data.paths, cfg.data.format, cfg.model.vocab_size,
                    cfg.model.seq_len, cfg.data.val_fraction);
  std::unique_ptr<testing::DeferredDevice> device;
  std::unique_ptr<StreamCollectives> stream, node_stream;
  if (!device_kind.empty()) {
    if (device_kind != "deferred" && device_kind != "deferred-stream") {
      std::fprintf(stderr, "rank_worker: unknown --device=%s\n", device_kind.c_str());
      return 2;
    }
    device = std::make_unique<testing::DeferredDevice>();
    if (device_kind == "deferred-stream" && who.world_size > 1) {
      DataGroupOptions o;
      o.backend = "gloo";
      stream = std::make_unique<testing::DeferredStreamCollectives>(*device, *comm->open_data_group(o));
      // Ranks on several nodes: the node's group, for a plan with the
      // secondary shard (opened whether the plan uses it or not).
      if (who.local_world_size > 1 && who.local_world_size < who.world_size) {
        node_stream = std::make_unique<testing::DeferredStreamCollectives>(*device, *comm->open_node_group(o));
      }
    }
  }
  Trainer trainer(cfg, model, nullptr, comm.get(), who.local_world_size, device.get(), stream.get(),
                  node_stream.get());
  const bool lead = who.rank == 0;

  const int64_t window = cfg.model.seq_len + 1;
  const int64_t mine = cfg.gradient_accumulation_steps * cfg.train_micro_batch_size_per_gpu;
  std::vector<int64_t> batch(size_t(cfg.train_batch_size * window));
  std::mt19937_64 rng(cfg.run.seed);
  std::ofstream losses;
  if (lead) losses.open(out + ".losses");
  nlohmann::json steps = nlohmann::json::array();
  std::ofstream progress(out + ".rank" + std::to_string(who.rank) + ".steps");
  for (int64_t s = 1; s <= cfg.run.steps; ++s) {
    data.sample_train(rng, cfg.train_batch_size, batch.data());
    StepResult r = trainer.step(batch.data() + size_t(who.rank * mine * window));
    char line[64];
    std::snprintf(line, sizeof(line), "%.17g\n", r.loss);
    if (lead) losses << line << std::flush;
    progress << "step " << s << "\n" << std::flush;
    steps.push_back({{"h2d", r.links.h2d}, {"d2h", r.links.d2h}, {"nvme_read", r.links.nvme_read},
                     {"nvme_write", r.links.nvme_write}, {"net", r.net_bytes},
                     {"intra_node", r.intra_node_bytes}, {"speculation", r.speculation}});
  }
  trainer.finish();
  if (lead) {
    std::ofstream t(out + ".tensors");
    for (const BlockLayout& bl : trainer.layout().blocks()) {
      for (const ParamLayout& p : bl.params) t << bl.name << " " << p.spec.name << " " << p.spec.numel() << "\n";
    }
  }
  write_unpadded(trainer, Category::kMaster, out + ".master", lead);
  write_unpadded(trainer, Category::kExpAvg, out + ".exp_avg", lead);
  write_unpadded(trainer, Category::kExpAvgSq, out + ".exp_avg_sq", lead);
  write_unpadded(trainer, Category::kGrad, out + ".grad", lead);
  if (trainer.layout().has_frozen()) write_unpadded(trainer, Category::kFrozen, out + ".frozen", lead);
  nlohmann::json j;
  for (int c = 0; c < kNumCategories; ++c) {
    j["allocated"][category_name(Category(c))] = trainer.state().allocated_bytes(Category(c));
  }
  j["shard_space_numel"] = trainer.plan().state.shard_space_numel;
  j["parameter_count"] = trainer.layout().parameter_count();
  j["num_blocks"] = trainer.layout().num_blocks();
  j["steps"] = steps;
  std::ofstream(out + ".rank" + std::to_string(who.rank) + ".json") << j.dump() << "\n";
  comm->barrier();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank_worker: error: %s\n", e.what());
    return exit_code_for(e);
  }
}
