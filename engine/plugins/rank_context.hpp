// What the engine puts behind the opaque loom_rank handle that plugins receive:
// the interface the host API (host_api.cpp) forwards to. The runtime implements it
// (runtime::RankRuntime), so it decides how memory, devices and groups are provided.
#pragma once

#include <loom/loom_abi.h>

#include <string>

struct loom_rank_s {
  virtual ~loom_rank_s() = default;
  virtual int32_t global_rank() const = 0;
  virtual loom_status alloc(size_t bytes, void** out) = 0;
  virtual void free(void* ptr) = 0;
  virtual loom_status device(const loom_device_api** api, loom_device** dev, loom_stream** stream) = 0;
  virtual loom_status group(const std::string& kind, loom_group* out) = 0;
  virtual loom_status exec(const loom_exec_api** api, loom_exec** exec) = 0;
  // ABI 1.1: a service table this rank was given (name null = its default for
  // api_type); null sends the host to the process-wide default (find_service).
  virtual const void* service(int32_t /*api_type*/, const char* /*name*/) { return nullptr; }
};
