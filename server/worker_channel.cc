#include "worker_channel.h"

#include <google/protobuf/util/delimited_message_util.h>

namespace nsad::server {

WorkerChannel::WorkerChannel(int read_fd, int write_fd) : in_(read_fd), out_(write_fd) {}

bool WorkerChannel::Write(const google::protobuf::MessageLite& message) {
  return google::protobuf::util::SerializeDelimitedToZeroCopyStream(message, &out_) &&
         out_.Flush();
}

bool WorkerChannel::Read(google::protobuf::MessageLite* message) {
  bool clean_eof = false;
  return google::protobuf::util::ParseDelimitedFromZeroCopyStream(message, &in_, &clean_eof);
}

}  // namespace nsad::server
