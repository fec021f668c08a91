#!/usr/bin/env bash
# LibTorch's include folder carries protobuf 3.13 and fmt 12 headers that shadow Debian's
# protobuf 3.21 and break spdlog 1.10, so no translation unit (or header it includes from
# this project) may pull in both worlds. This checks every project source and header.
set -euo pipefail
cd "$(dirname "$0")/.."
torch_re='#include *[<"](torch/|ATen/|c10/|nsa_cuda\.h|model/|nsa/(ops|attention|reference|naive|dispatch)|trainer/)'
proto_re='#include *[<"](google/protobuf|grpc|grpcpp|spdlog|fmt/|prometheus/|nsa/v1/)'
# The trainer/ headers of nsa_engine_core (engine/CMakeLists.txt), which builds without torch's
# include folder, so they cannot bring torch: server code may include them.
core_re='#include *"trainer/(config_text|checkpoint_store|resume_target)\.h"'
bad=0
while IFS= read -r f; do
  # Follow project-local includes one level: a header that brings torch counts as torch.
  if grep -vE "$core_re" "$f" | grep -qE "$torch_re" && grep -qE "$proto_re" "$f"; then
    echo "header hygiene: $f includes both torch and protobuf/gRPC/spdlog headers" >&2
    bad=1
  fi
done < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh' 2>/dev/null || find . -name '*.cc' -o -name '*.h')
[ $bad -eq 0 ] && echo "[hygiene] ok: no translation unit mixes torch with protobuf/gRPC/spdlog"
exit $bad
