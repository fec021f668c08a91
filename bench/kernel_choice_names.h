// Command-line names of the kernel choices (kernels/kernel_choice.h), one table per choice,
// shared by nsa_bench and train_bench so that both take the same spellings.
// Torch-free, like kernel_choice.h.
#pragma once

#include <cstddef>
#include <cstdio>
#include <string>
#include <utility>

#include "kernel_choice.h"

namespace nsad::bench {

using SelectedChoice = nsa::cuda::detail::SelectedKernelChoice;
using WindowChoice = nsa::cuda::detail::WindowKernelChoice;
using CompressedChoice = nsa::cuda::detail::CompressedKernelChoice;
using TiledChoice = nsa::cuda::detail::TiledForwardChoice;
using GemmChoice = nsa::cuda::detail::GemmChoice;

constexpr std::pair<const char*, SelectedChoice::Fwd> kSlcFwdNames[] = {
    {"auto", SelectedChoice::Fwd::kAuto},   {"rows", SelectedChoice::Fwd::kRows},
    {"heads", SelectedChoice::Fwd::kHeads}, {"tiled", SelectedChoice::Fwd::kTiled},
    {"blocks", SelectedChoice::Fwd::kBlocks}};
constexpr std::pair<const char*, SelectedChoice::DkDv> kSlcDkDvNames[] = {
    {"auto", SelectedChoice::DkDv::kAuto},             {"staged16x3", SelectedChoice::DkDv::kStaged16x3},
    {"staged32x1", SelectedChoice::DkDv::kStaged32x1}, {"staged32x3", SelectedChoice::DkDv::kStaged32x3},
    {"unstaged", SelectedChoice::DkDv::kUnstaged},     {"wgmma", SelectedChoice::DkDv::kWgmma}};
constexpr std::pair<const char*, SelectedChoice::Dq> kSlcDqNames[] = {
    {"auto", SelectedChoice::Dq::kAuto}, {"query", SelectedChoice::Dq::kQuerySide},
    {"fused", SelectedChoice::Dq::kFused}};
constexpr std::pair<const char*, SelectedChoice::Order> kSlcOrderNames[] = {
    {"auto", SelectedChoice::Order::kAuto}, {"block", SelectedChoice::Order::kBlock},
    {"position", SelectedChoice::Order::kPosition}};
constexpr std::pair<const char*, SelectedChoice::Combine> kSlcCombineNames[] = {
    {"auto", SelectedChoice::Combine::kAuto}, {"one", SelectedChoice::Combine::kOne},
    {"batch4", SelectedChoice::Combine::kBatch4}};
constexpr std::pair<const char*, SelectedChoice::Local> kSlcLocalNames[] = {
    {"auto", SelectedChoice::Local::kAuto}, {"blocks", SelectedChoice::Local::kInBlocks},
    {"tiled", SelectedChoice::Local::kTiledPass}, {"kernel", SelectedChoice::Local::kLocalKernel}};
constexpr std::pair<const char*, WindowChoice::Forward> kWinFwdNames[] = {
    {"auto", WindowChoice::Forward::kAuto}, {"flash", WindowChoice::Forward::kFlash},
    {"tiled", WindowChoice::Forward::kTiled}};
constexpr std::pair<const char*, WindowChoice::Backward> kWinBwdNames[] = {
    {"auto", WindowChoice::Backward::kAuto}, {"flash", WindowChoice::Backward::kFlash},
    {"wgmma", WindowChoice::Backward::kWgmma}};
constexpr std::pair<const char*, TiledChoice::Mma> kTiledMmaNames[] = {
    {"auto", TiledChoice::Mma::kAuto}, {"sync", TiledChoice::Mma::kSync}, {"wgmma", TiledChoice::Mma::kWgmma},
    {"wgmma1", TiledChoice::Mma::kWgmmaOneWarpgroup}, {"wgmma-overlap", TiledChoice::Mma::kWgmmaOverlap}};
constexpr std::pair<const char*, GemmChoice::Algo> kGemmNames[] = {
    {"auto", GemmChoice::Algo::kAuto}, {"cublas", GemmChoice::Algo::kCublas}, {"tuned", GemmChoice::Algo::kTuned}};
constexpr std::pair<const char*, CompressedChoice::Map> kCmpMapNames[] = {
    {"auto", CompressedChoice::Map::kAuto}, {"product", CompressedChoice::Map::kProduct},
    {"slots", CompressedChoice::Map::kSlots}, {"lane-sync", CompressedChoice::Map::kLaneSync}};
constexpr std::pair<const char*, CompressedChoice::KeySide> kCmpKeySideNames[] = {
    {"auto", CompressedChoice::KeySide::kAuto}, {"smem", CompressedChoice::KeySide::kSmem},
    {"wgmma", CompressedChoice::KeySide::kWgmma}};
constexpr std::pair<const char*, CompressedChoice::Pass> kCmpPassNames[] = {
    {"auto", CompressedChoice::Pass::kAuto}, {"two", CompressedChoice::Pass::kTwo}};
constexpr std::pair<const char*, CompressedChoice::Path> kCmpNames[] = {
    {"auto", CompressedChoice::Path::kAuto}, {"own", CompressedChoice::Path::kOwn},
    {"registers", CompressedChoice::Path::kRegisters},
    {"dense", CompressedChoice::Path::kDense}};

// Value of a name in one of the tables; false when the name is not there.
template <typename E, std::size_t N>
bool FromName(const std::pair<const char*, E> (&names)[N], const std::string& name, E& out) {
  for (const auto& [n, e] : names)
    if (name == n) return out = e, true;
  return false;
}
template <typename E, std::size_t N>
const char* NameOf(const std::pair<const char*, E> (&names)[N], E e) {
  for (const auto& [n, v] : names)
    if (v == e) return n;
  return "?";
}
// The names a flag takes, for its error message: "auto|rows|...".
template <typename E, std::size_t N>
std::string Spellings(const std::pair<const char*, E> (&names)[N]) {
  std::string all;
  for (const auto& [n, e] : names) all += (all.empty() ? "" : "|") + std::string(n);
  return all;
}

// A kernel-choice flag's value: FromName, and on an unknown name "<flag> takes a|b|..." on
// stderr (the caller then exits with status 2).
template <typename E, std::size_t N>
bool ParseChoiceFlag(const char* flag, const std::pair<const char*, E> (&names)[N], const std::string& value,
                     E& out) {
  if (FromName(names, value, out)) return true;
  std::fprintf(stderr, "%s takes %s\n", flag, Spellings(names).c_str());
  return false;
}

// A choice with one field set from a flag's value (the other fields at their defaults), set
// process-wide through `set`; false (after ParseChoiceFlag's message) for an unknown name.
template <typename Choice, typename E, std::size_t N>
bool SetOneFieldChoice(const char* flag, const std::pair<const char*, E> (&names)[N], const std::string& value,
                       E Choice::*field, void (*set)(const Choice&)) {
  Choice choice;
  if (!ParseChoiceFlag(flag, names, value, choice.*field)) return false;
  set(choice);
  return true;
}

}  // namespace nsad::bench
