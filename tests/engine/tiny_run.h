// The fixture shared by the trainer suites: a tiny learnable corpus written as token shards
// into a temporary directory, and a tiny CPU model config that trains in milliseconds.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "../common/temp_dir.h"
#include "data/shard.h"
#include "nsad/engine.h"

namespace nsad {

namespace fs = std::filesystem;

class TrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = tmp_.path();
    // A repeated phrase: learnable in a few dozen steps.
    const std::string phrase = "native sparse attention trains fast. ";
    std::vector<uint32_t> tokens;
    for (int i = 0; i < 300; ++i) {
      for (unsigned char c : phrase) tokens.push_back(c);
    }
    data::WriteShard((dir_ / "train.bin").string(), tokens, data::TokenWidth::kUint16);
    tokens.resize(4000);
    data::WriteShard((dir_ / "val.bin").string(), tokens, data::TokenWidth::kUint16);
  }

  TrainConfig Tiny() const {
    TrainConfig c;
    c.model.dim = 32;
    c.model.n_layers = 1;
    c.model.n_heads = 2;
    c.model.n_kv_groups = 1;
    c.model.head_dim = 16;
    c.model.nsa = {8, 4, 16, 4, 32};
    c.data.train_path = (dir_ / "train.bin").string();
    c.data.val_path = (dir_ / "val.bin").string();
    c.seq_len = 64;
    c.batch_size = 4;
    c.max_steps = 40;
    c.optim.warmup_steps = 5;
    c.device = "cpu";
    c.eval_batches = 2;
    return c;
  }

  testing::TempDir tmp_{"nsad-trainer-test"};
  fs::path dir_;
};

}  // namespace nsad
