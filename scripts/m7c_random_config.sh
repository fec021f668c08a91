#!/usr/bin/env bash
# Writes what a GPU script needs to train m7c 125M through the daemon without a dataset:
# STATE/data/random_train_000000.bin (4M random GPT-2-vocabulary tokens, llm.c format) and
# STATE/m7c.json (configs/m7c_125m.json on that shard, STEPS steps, no validation runs).
#   scripts/m7c_random_config.sh STATE STEPS
set -euo pipefail
state=$1 steps=$2
mkdir -p "$state/data"
python3 - "$state/data/random_train_000000.bin" <<'PY'
import struct, sys, random
n = 4_000_000; random.seed(0)
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<256i", 20240520, 1, n, *([0] * 253)))
    f.write(struct.pack("<%dH" % n, *(random.randrange(50257) for _ in range(n))))
PY
sed -e "s#data/fineweb10B/fineweb_train_\*.bin#$state/data/random_train_*.bin#" \
    -e 's#"val_path": "data/fineweb10B/fineweb_val_\*.bin"#"val_fraction": 0.01#' \
    -e "s#\"max_steps\": 50000#\"max_steps\": $steps#" -e 's#"eval_every": 500#"eval_every": 0#' \
    "$(dirname "$0")/../configs/m7c_125m.json" > "$state/m7c.json"
