# nsa_alert_webhook: the Alertmanager webhook receiver (server/alert_webhook.{h,cc}).
# Included from server/CMakeLists.txt; tests/client includes it too when it has not been.
include_guard(GLOBAL)

# Debian's libcivetweb-dev ships no CMake package config, hence find_path/find_library.
# It is the same civetweb that prometheus-cpp's pull library links.
find_path(CIVETWEB_INCLUDE_DIR CivetServer.h REQUIRED)
find_library(CIVETWEB_LIBRARY civetweb REQUIRED)
find_library(CIVETWEB_CPP_LIBRARY civetweb-cpp REQUIRED)

add_library(nsa_alert_webhook STATIC ${CMAKE_CURRENT_LIST_DIR}/alert_webhook.cc)
target_include_directories(nsa_alert_webhook PUBLIC ${CMAKE_CURRENT_LIST_DIR})
target_include_directories(nsa_alert_webhook SYSTEM PRIVATE ${CIVETWEB_INCLUDE_DIR})
# ${Protobuf_LIBRARIES}: see client/CMakeLists.txt (Torch's placeholder protobuf target).
target_link_libraries(nsa_alert_webhook
  PUBLIC ${Protobuf_LIBRARIES}
  PRIVATE ${CIVETWEB_CPP_LIBRARY} ${CIVETWEB_LIBRARY} Threads::Threads)
target_include_directories(nsa_alert_webhook SYSTEM PRIVATE ${Protobuf_INCLUDE_DIRS})
