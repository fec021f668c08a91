#!/usr/bin/env bash
# Builds nsad's embedded default dataset: the plain-text fortune cookies of the Debian
# package `fortunes`, byte-tokenized (vocabulary 256) into llm.c-format shards by nsa-shard.
#
#   scripts/make_default_dataset.sh OUT_DIR BUILD_DIR
#
# OUT_DIR gets fortunes_val_000000.bin (the first 131072 bytes) and fortunes_train_*.bin (the
# rest, ~1M tokens per shard), plus fortunes.manifest. Train on it with
#   data.train_path = OUT_DIR/fortunes_train_*.bin
#   data.val_path   = OUT_DIR/fortunes_val_*.bin
# BUILD_DIR is a CMake build tree with the nsa-shard target built.
#
# Idempotent: the manifest records a hash of the inputs and options and the hash of every
# shard; when both still match, the script does nothing.
set -euo pipefail

FORMAT="nsad-default-dataset/1"  # bump when the options below or the tokenizer change
PREFIX="fortunes"
SHARD_TOKENS=1000000
VAL_TOKENS=131072
FORTUNES_DIR="${NSAD_FORTUNES_DIR:-/usr/share/games/fortunes}"

die() { echo "make_default_dataset: error: $*" >&2; exit 1; }

[[ $# -eq 2 ]] || { echo "usage: $0 OUT_DIR BUILD_DIR" >&2; exit 2; }
OUT_DIR=$1
BUILD_DIR=$2

# The plain-text fortune files: regular files without the .dat index / .u8 extension
# (find does not follow symlinks, so the *.u8 -> * links and directories are skipped).
INPUTS=()
if [[ -d "$FORTUNES_DIR" ]]; then
  while IFS= read -r -d '' file; do INPUTS+=("$file"); done < <(
    find "$FORTUNES_DIR" -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' -print0 |
      LC_ALL=C sort -z)
fi
[[ ${#INPUTS[@]} -gt 0 ]] ||
  die "no fortune text files in $FORTUNES_DIR: the Debian package 'fortunes' is not" \
      "installed (apt-get install fortunes)"

NSA_SHARD=""
for candidate in "$BUILD_DIR/engine/nsa-shard" "$BUILD_DIR/bin/nsa-shard" "$BUILD_DIR/nsa-shard"; do
  if [[ -x "$candidate" ]]; then NSA_SHARD=$candidate; break; fi
done
[[ -n "$NSA_SHARD" ]] ||
  die "nsa-shard not found in $BUILD_DIR; build it: cmake --build $BUILD_DIR --target nsa-shard"

# One hash over everything the output depends on: format, options, input names and contents.
INPUT_HASH=$(
  {
    echo "$FORMAT prefix=$PREFIX shard_tokens=$SHARD_TOKENS val_tokens=$VAL_TOKENS"
    for file in "${INPUTS[@]}"; do
      echo "$(basename "$file") $(sha256sum < "$file" | cut -d' ' -f1)"
    done
  } | sha256sum | cut -d' ' -f1)

MANIFEST="$OUT_DIR/$PREFIX.manifest"
if [[ -f "$MANIFEST" ]] && [[ "$(head -n 1 "$MANIFEST")" == "# inputs $INPUT_HASH" ]] &&
   (cd "$OUT_DIR" && tail -n +2 "$PREFIX.manifest" | sha256sum --check --quiet --status); then
  echo "make_default_dataset: $OUT_DIR is up to date (${#INPUTS[@]} fortune files)"
  exit 0
fi

mkdir -p "$OUT_DIR"
rm -f "$MANIFEST"  # a failed rebuild must not look up to date
"$NSA_SHARD" --force --out "$OUT_DIR" --prefix "$PREFIX" \
  --shard-tokens "$SHARD_TOKENS" --val-tokens "$VAL_TOKENS" "${INPUTS[@]}"

{
  echo "# inputs $INPUT_HASH"
  (cd "$OUT_DIR" && sha256sum "$PREFIX"_val_*.bin "$PREFIX"_train_*.bin)
} > "$MANIFEST.tmp"
mv "$MANIFEST.tmp" "$MANIFEST"
echo "make_default_dataset: wrote $OUT_DIR from ${#INPUTS[@]} fortune files"
echo "  data.train_path = $OUT_DIR/${PREFIX}_train_*.bin"
echo "  data.val_path   = $OUT_DIR/${PREFIX}_val_*.bin"
