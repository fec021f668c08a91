// gRPC front of the RunManager: request validation lives in the manager, so this layer
// stays a thin, mechanical mapping of RPCs.
#pragma once

#include "nsa/v1/trainer.grpc.pb.h"
#include "run_manager.h"

namespace nsad::server {

class TrainerService final : public nsa::v1::Trainer::Service {
 public:
  explicit TrainerService(RunManager* runs) : runs_(runs) {}

  grpc::Status StartRun(grpc::ServerContext*, const nsa::v1::StartRunRequest* request,
                        nsa::v1::StartRunResponse* response) override {
    return runs_->Start(*request, response->mutable_run());
  }
  grpc::Status PauseRun(grpc::ServerContext*, const nsa::v1::RunRequest* request,
                        nsa::v1::RunResponse* response) override {
    return runs_->Pause(request->run_id(), response->mutable_run());
  }
  grpc::Status ResumeRun(grpc::ServerContext*, const nsa::v1::RunRequest* request,
                         nsa::v1::RunResponse* response) override {
    return runs_->Resume(request->run_id(), response->mutable_run());
  }
  grpc::Status HaltRun(grpc::ServerContext*, const nsa::v1::HaltRunRequest* request,
                       nsa::v1::RunResponse* response) override {
    return runs_->Halt(request->run_id(), request->reason(), response->mutable_run());
  }
  grpc::Status GetRun(grpc::ServerContext*, const nsa::v1::RunRequest* request,
                      nsa::v1::RunResponse* response) override {
    return runs_->Get(request->run_id(), response->mutable_run());
  }
  grpc::Status ListRuns(grpc::ServerContext*, const nsa::v1::ListRunsRequest* request,
                        nsa::v1::ListRunsResponse* response) override {
    return runs_->List(*request, response);
  }
  grpc::Status WatchRun(grpc::ServerContext* context, const nsa::v1::WatchRunRequest* request,
                        grpc::ServerWriter<nsa::v1::RunEvent>* writer) override {
    return runs_->Watch(request->run_id(), context, writer);
  }
  grpc::Status InspectGates(grpc::ServerContext*, const nsa::v1::RunRequest* request,
                            nsa::v1::InspectGatesResponse* response) override {
    return runs_->Gates(request->run_id(), response);
  }
  grpc::Status GetThroughput(grpc::ServerContext*, const nsa::v1::RunRequest* request,
                             nsa::v1::GetThroughputResponse* response) override {
    return runs_->Throughput(request->run_id(), response);
  }

 private:
  RunManager* runs_;
};

}  // namespace nsad::server
