// Length-delimited protobuf messages over a pair of file descriptors: the transport between
// nsad and an nsad-worker (see proto/nsa/v1/worker.proto). Blocking; one caller at a time.
#pragma once

#include <google/protobuf/io/zero_copy_stream_impl.h>
#include <google/protobuf/message_lite.h>

namespace nsad::server {

class WorkerChannel {
 public:
  WorkerChannel(int read_fd, int write_fd);  // does not take ownership of the fds

  // False when the peer is gone (EOF, broken pipe) or the bytes are not a message.
  bool Write(const google::protobuf::MessageLite& message);
  bool Read(google::protobuf::MessageLite* message);

 private:
  google::protobuf::io::FileInputStream in_;
  google::protobuf::io::FileOutputStream out_;
};

}  // namespace nsad::server
