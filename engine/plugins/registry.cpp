#include "engine/plugins/registry.hpp"

#include <boost/dll/shared_library.hpp>
#include <boost/filesystem.hpp>

#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cctype>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

namespace loom::plugins {
namespace {

namespace fs = boost::filesystem;

// Libraries stay loaded for the life of the process (plugins hand out pointers
// into their own static data), so the handles are kept here and never released.
std::vector<boost::dll::shared_library>& loaded_libraries() {
  static auto* libs = new std::vector<boost::dll::shared_library>();
  return *libs;
}

std::string version_str(uint32_t major, uint32_t minor) {
  return std::to_string(major) + "." + std::to_string(minor);
}

int32_t expected_api_type(const std::string& kind, int32_t api_type) {
  if (kind == "device") return LOOM_API_DEVICE;
  if (kind == "comm") return LOOM_API_COMM;
  if (kind == "layer") return LOOM_API_LAYER;
  if (kind == "exec") return LOOM_API_EXEC;
  if (kind == "parallel")
    return (api_type == LOOM_API_OPTIMIZER || api_type == LOOM_API_SCHEDULE || api_type == LOOM_API_TENSOR_PARALLEL ||
            api_type == LOOM_API_EXPERT_PARALLEL)
               ? api_type
               : LOOM_API_OPTIMIZER;
  return -1;
}

// A kind or name: what a manifest writes and a file name may hold (up to 64 of
// [a-z0-9_.-], starting with a letter or digit: not "..").
bool valid_name(const std::string& s) {
  if (s.empty() || s.size() > 64 || !((s[0] >= 'a' && s[0] <= 'z') || (s[0] >= '0' && s[0] <= '9'))) return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-';
  });
}

// A plugin's own text (version, description, a status message) as loom prints it: at
// most `limit` bytes, control characters (a newline or an escape that would forge or
// recolour a line of the listing) as '?'.
std::string printable(const char* text, size_t limit) {
  std::string s = text != nullptr ? std::string(text, ::strnlen(text, limit + 1)) : "";
  if (s.size() > limit) s = s.substr(0, limit) + "...";
  for (char& c : s)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  return s;
}

manifest::OptionDecl::Type option_type(int32_t t, bool& ok) {
  ok = true;
  switch (t) {
    case LOOM_OPTION_BOOL: return manifest::OptionDecl::Type::Bool;
    case LOOM_OPTION_INT: return manifest::OptionDecl::Type::Int;
    case LOOM_OPTION_FLOAT: return manifest::OptionDecl::Type::Float;
    case LOOM_OPTION_STRING: return manifest::OptionDecl::Type::String;
    default: ok = false; return manifest::OptionDecl::Type::Int;
  }
}

// Option j of a library's array, read with the stride of the library's own
// struct (options[0].struct_size: smaller for a library built before 1.9).
manifest::OptionDecl read_option(const loom_option_decl* options, size_t j, const std::string& who) {
  const uint32_t stride = options[0].struct_size;
  const auto* d = reinterpret_cast<const loom_option_decl*>(reinterpret_cast<const char*>(options) + j * stride);
  const std::string where = who + " option #" + std::to_string(j);
  if (stride < offsetof(loom_option_decl, doc) + sizeof(d->doc) || d->struct_size != stride)
    throw PluginError(where + " has struct_size " + std::to_string(d->struct_size) +
                      (j > 0 ? " (the first option's is " + std::to_string(stride) + ")" : "") +
                      "; every option of the array must carry the size of loom_option_decl it was built with");
  bool ok = false;
  manifest::OptionDecl od{option_type(d->type, ok), d->name ? d->name : "", std::nullopt, d->doc ? d->doc : "", {}};
  if (!ok || od.name.empty()) throw PluginError(where + " has no name or an unknown type");
  // A key a manifest can write bare in the layer's table.
  const bool key_like = od.name.size() <= 64 && std::isalpha(static_cast<unsigned char>(od.name[0])) &&
                        std::all_of(od.name.begin(), od.name.end(), [](char c) {
                          return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-';
                        });
  if (!key_like)
    throw PluginError(where + " is named '" + printable(od.name.c_str(), 64) +
                      "'; an option name is up to 64 letters, digits, '_' or '-', starting with a letter");
  const bool numeric = od.type == manifest::OptionDecl::Type::Int || od.type == manifest::OptionDecl::Type::Float;
  const char* range = LOOM_HAS_SLOT(d, loom_option_decl, range) ? d->range : nullptr;
  const char* choices = LOOM_HAS_SLOT(d, loom_option_decl, choices) ? d->choices : nullptr;
  const std::string named = who + " option '" + od.name + "'";
  if ((range != nullptr && !numeric) || (choices != nullptr && od.type != manifest::OptionDecl::Type::String))
    throw PluginError(named + ": a range is for integer and float options, choices for string options");
  try {
    od.bounds = manifest::ValueBounds::parse(range, choices);
  } catch (const std::invalid_argument& e) {
    throw PluginError(named + ": " + e.what());
  }
  if (d->default_value == nullptr) return od;
  od.default_value = d->default_value;
  std::unique_ptr<toml::table> literal;
  try {
    literal = std::make_unique<toml::table>(toml::parse("v = " + *od.default_value));
  } catch (const toml::parse_error&) {
  }
  // One value and nothing after it ("1.0\nevil = 3" would parse as a table of two).
  const toml::node* v = literal && literal->size() == 1 ? literal->get("v") : nullptr;
  const bool type_ok = v != nullptr && (od.type == manifest::OptionDecl::Type::Bool     ? v->is_boolean()
                                        : od.type == manifest::OptionDecl::Type::Int    ? v->is_integer()
                                        : od.type == manifest::OptionDecl::Type::String ? v->is_string()
                                                                                        : v->is_number());
  if (!type_ok)
    throw PluginError(named + " has default '" + printable(od.default_value->c_str(), 256) +
                      "' that does not match its declared type");
  if (v->is_floating_point() && !std::isfinite(v->as_floating_point()->get()))
    throw PluginError(named + " has default " + *od.default_value + ", not a finite number (as every value it takes)");
  if (const std::string problem = od.bounds.problem(*v); !problem.empty())
    throw PluginError(named + " has a default outside what it allows: the value " + problem);
  return od;
}

// Converts a status from a plugin into text and frees it.
std::string take_message(loom_status s) {
  const loom_host_api* h = host_api();
  std::string m = printable(h->status_message(s), 4096);
  h->status_destroy(s);
  return m;
}

// --- The file, before the dynamic loader sees it ---------------------------------
// dlopen maps each PT_LOAD segment's file range as it is: a range past the end of
// the file (a truncated copy) is mapped anyway and the loader's first touch of it
// raises SIGBUS. So the file is read first and refused unless it is a regular ELF
// shared object of this machine whose headers, segments and sections lie inside it.

constexpr unsigned char kNativeClass = sizeof(void*) == 8 ? ELFCLASS64 : ELFCLASS32;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
constexpr unsigned char kNativeData = ELFDATA2MSB;
#else
constexpr unsigned char kNativeData = ELFDATA2LSB;
#endif
#if defined(__x86_64__)
constexpr int kNativeMachine = EM_X86_64;
#elif defined(__aarch64__)
constexpr int kNativeMachine = EM_AARCH64;
#elif defined(__i386__)
constexpr int kNativeMachine = EM_386;
#elif defined(__arm__)
constexpr int kNativeMachine = EM_ARM;
#elif defined(__powerpc64__)
constexpr int kNativeMachine = EM_PPC64;
#elif defined(__riscv)
constexpr int kNativeMachine = EM_RISCV;
#elif defined(__s390x__)
constexpr int kNativeMachine = EM_S390;
#else
constexpr int kNativeMachine = -1;  // not checked: dlopen says it
#endif

std::string file_kind(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a named pipe";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// Reads exactly n bytes at off; false on a short read or an error.
bool read_at(int fd, uint64_t off, void* buf, size_t n) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    const ssize_t got = ::pread(fd, p, n, static_cast<off_t>(off));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got;
    off += static_cast<uint64_t>(got);
    n -= static_cast<size_t>(got);
  }
  return true;
}

// [off, off + count * entry) inside a file of `size` bytes (no overflow); end receives off + count * entry.
bool inside(uint64_t off, uint64_t count, uint64_t entry, uint64_t size, uint64_t& end) {
  if (entry != 0 && count > (UINT64_MAX - off) / entry) return false;
  end = off + count * entry;
  return end <= size;
}

const char* segment_name(uint32_t type) {
  switch (type) {
    case PT_LOAD: return "PT_LOAD";
    case PT_DYNAMIC: return "PT_DYNAMIC";
    case PT_INTERP: return "PT_INTERP";
    case PT_NOTE: return "PT_NOTE";
    case PT_PHDR: return "PT_PHDR";
    case PT_TLS: return "PT_TLS";
    case PT_GNU_EH_FRAME: return "PT_GNU_EH_FRAME";
    case PT_GNU_RELRO: return "PT_GNU_RELRO";
    case PT_GNU_PROPERTY: return "PT_GNU_PROPERTY";
    default: return "segment";
  }
}

// Why `file` must not be handed to dlopen, as "<what is wrong>; <what to do>", or ""
// when it may be.
std::string file_problem(const std::string& file) {
  const std::string rebuild = "rebuild the plugin (or copy it again: a partial copy is truncated)";
  const std::string not_plugin = "check that it is a loom plugin built for this platform";
  struct stat st {};
  if (::stat(file.c_str(), &st) != 0) {
    const int err = errno;
    return std::string("cannot be read (") + std::strerror(err) + "); check that it exists and is readable";
  }
  if (!S_ISREG(st.st_mode))
    return "is " + file_kind(st.st_mode) + ", not a shared library file; remove it from the plugin directory";
  Fd f;
  f.fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (f.fd < 0) {
    const int err = errno;
    return std::string("cannot be read (") + std::strerror(err) + "); check its permissions";
  }
  if (::fstat(f.fd, &st) != 0 || !S_ISREG(st.st_mode))
    return "is not a regular file; remove it from the plugin directory";
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  const std::string has = " but the file has " + std::to_string(size) + " bytes";

  unsigned char ident[EI_NIDENT];
  if (size < EI_NIDENT || !read_at(f.fd, 0, ident, EI_NIDENT))
    return "is not an ELF shared object (" + std::to_string(size) + " bytes, too short for an ELF header); " +
           not_plugin;
  if (std::memcmp(ident, ELFMAG, SELFMAG) != 0) return "is not an ELF shared object (no ELF magic number); " + not_plugin;
  if (ident[EI_CLASS] != kNativeClass)
    return std::string("is a ") + (ident[EI_CLASS] == ELFCLASS32 ? "32-bit" : ident[EI_CLASS] == ELFCLASS64 ? "64-bit" : "corrupt") +
           " ELF file (EI_CLASS " + std::to_string(ident[EI_CLASS]) + ") but this engine is " +
           (kNativeClass == ELFCLASS64 ? "64-bit" : "32-bit") + "; rebuild the plugin for this platform";
  if (ident[EI_DATA] != kNativeData)
    return std::string("is a ") +
           (ident[EI_DATA] == ELFDATA2MSB ? "big-endian" : ident[EI_DATA] == ELFDATA2LSB ? "little-endian" : "corrupt") +
           " ELF file (EI_DATA " + std::to_string(ident[EI_DATA]) + ") but this machine is " +
           (kNativeData == ELFDATA2LSB ? "little-endian" : "big-endian") + "; rebuild the plugin for this platform";
  ElfW(Ehdr) eh;
  if (size < sizeof(eh) || !read_at(f.fd, 0, &eh, sizeof(eh)))
    return "is truncated: its ELF header needs " + std::to_string(sizeof(eh)) + " bytes" + has + "; " + rebuild;
  if (eh.e_type != ET_DYN)
    return std::string("is an ELF ") +
           (eh.e_type == ET_EXEC ? "executable" : eh.e_type == ET_REL ? "object file (.o)" : eh.e_type == ET_CORE ? "core dump" : "file") +
           " (e_type " + std::to_string(eh.e_type) + "), not a shared library; build it with loom_add_plugin";
  if (kNativeMachine >= 0 && eh.e_machine != kNativeMachine)
    return "is built for another processor (ELF e_machine " + std::to_string(eh.e_machine) + ", this engine's is " +
           std::to_string(kNativeMachine) + "); rebuild the plugin for this platform";

  // Program headers: the table and every segment's bytes in the file.
  uint64_t end = 0;
  uint64_t phnum = eh.e_phnum;
  if (phnum == PN_XNUM) {  // more than 0xfffe: the count is section 0's sh_info
    ElfW(Shdr) first{};
    if (eh.e_shoff == 0 || !inside(eh.e_shoff, 1, sizeof(first), size, end) ||
        !read_at(f.fd, eh.e_shoff, &first, sizeof(first)))
      return "is truncated or corrupt: its program header count is in a section header the file does not hold; " +
             rebuild;
    phnum = first.sh_info;
  }
  if (phnum == 0) return "has no program headers, so it cannot be loaded as a shared library; " + not_plugin;
  if (eh.e_phentsize != sizeof(ElfW(Phdr)))
    return "is corrupt: its program headers are " + std::to_string(eh.e_phentsize) + " bytes each, not " +
           std::to_string(sizeof(ElfW(Phdr))) + "; " + rebuild;
  if (!inside(eh.e_phoff, phnum, sizeof(ElfW(Phdr)), size, end))
    return "is truncated: its program header table ends at byte " + std::to_string(end) + has + "; " + rebuild;
  std::vector<ElfW(Phdr)> ph(phnum);
  if (!read_at(f.fd, eh.e_phoff, ph.data(), phnum * sizeof(ElfW(Phdr))))
    return "cannot be read (program header table); " + rebuild;
  for (size_t i = 0; i < ph.size(); ++i) {
    const ElfW(Phdr)& p = ph[i];
    if (p.p_filesz == 0) continue;
    if (!inside(p.p_offset, 1, p.p_filesz, size, end))
      return "is truncated: segment #" + std::to_string(i) + " (" + segment_name(p.p_type) + ") covers bytes " +
             std::to_string(p.p_offset) + ".." + std::to_string(p.p_offset + p.p_filesz) + has + "; " + rebuild;
    if (p.p_type == PT_LOAD && p.p_filesz > p.p_memsz)
      return "is corrupt: segment #" + std::to_string(i) + " (PT_LOAD) has more bytes in the file (" +
             std::to_string(p.p_filesz) + ") than in memory (" + std::to_string(p.p_memsz) + "); " + rebuild;
  }
  // The section header table (section 0 holds the count when it does not fit e_shnum).
  std::vector<ElfW(Shdr)> sh;
  if (eh.e_shoff != 0) {
    if (eh.e_shentsize != sizeof(ElfW(Shdr)))
      return "is corrupt: its section headers are " + std::to_string(eh.e_shentsize) + " bytes each, not " +
             std::to_string(sizeof(ElfW(Shdr))) + "; " + rebuild;
    uint64_t count = eh.e_shnum;
    ElfW(Shdr) first{};
    if (!inside(eh.e_shoff, 1, sizeof(first), size, end) || !read_at(f.fd, eh.e_shoff, &first, sizeof(first)))
      return "is truncated: its section header table starts at byte " + std::to_string(eh.e_shoff) + has + "; " + rebuild;
    if (count == 0) count = first.sh_size;  // SHN_LORESERVE or more sections
    if (!inside(eh.e_shoff, count, sizeof(ElfW(Shdr)), size, end))
      return "is truncated: its section header table (" + std::to_string(count) + " entries from byte " +
             std::to_string(eh.e_shoff) + ") ends at byte " + std::to_string(end) + has + "; " + rebuild;
    sh.resize(count);
    if (count > 0 && !read_at(f.fd, eh.e_shoff, sh.data(), count * sizeof(ElfW(Shdr))))
      return "cannot be read (section header table); " + rebuild;
  }

  // Sections' bytes (a cut that spares the segments but not the symbols or debug info).
  for (size_t i = 1; i < sh.size(); ++i) {
    const ElfW(Shdr)& s = sh[i];
    if (s.sh_type == SHT_NOBITS || s.sh_type == SHT_NULL || s.sh_size == 0) continue;
    if (!inside(s.sh_offset, 1, s.sh_size, size, end))
      return "is truncated: section #" + std::to_string(i) + " covers bytes " + std::to_string(s.sh_offset) + ".." +
             std::to_string(s.sh_offset + s.sh_size) + has + "; " + rebuild;
  }
  return "";
}

// --- The entry point, before it is called ----------------------------------------

const char* symbol_type_name(int type) {
  switch (type) {
    case STT_NOTYPE: return "an untyped symbol";
    case STT_OBJECT: return "a data object";
    case STT_SECTION: return "a section";
    case STT_FILE: return "a file symbol";
    case STT_COMMON: return "a common (data) block";
    case STT_TLS: return "a thread-local variable";
    default: return "not a function";
  }
}

struct CodeSearch {
  uintptr_t addr = 0;
  bool executable = false;
};

int find_code(struct dl_phdr_info* info, size_t, void* data) {
  auto* s = static_cast<CodeSearch*>(data);
  for (ElfW(Half) i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& p = info->dlpi_phdr[i];
    if (p.p_type != PT_LOAD) continue;
    const uintptr_t start = info->dlpi_addr + p.p_vaddr;
    if (s->addr >= start && s->addr - start < p.p_memsz) {
      s->executable = (p.p_flags & PF_X) != 0;
      return 1;
    }
  }
  return 0;
}

// Why the entry symbol found at `addr` cannot be called, or "" when it is code:
// a data object exported under the entry's name (`int loom_plugin_init_v1 = 5;`)
// would be jumped into.
std::string entry_problem(void* addr) {
  Dl_info info{};
  void* extra = nullptr;
  if (::dladdr1(addr, &info, &extra, RTLD_DL_SYMENT) != 0 && extra != nullptr && info.dli_saddr == addr) {
    const auto* sym = static_cast<const ElfW(Sym)*>(extra);
    const int type = ELF64_ST_TYPE(sym->st_info);  // the same low 4 bits in ELF32_ST_TYPE
    if (type != STT_FUNC && type != STT_GNU_IFUNC)
      return std::string("is ") + symbol_type_name(type) + " (ELF symbol type " + std::to_string(type) +
             "), not a function";
  }
  CodeSearch s;
  s.addr = reinterpret_cast<uintptr_t>(addr);
  ::dl_iterate_phdr(find_code, &s);
  if (!s.executable) return "does not point into executable code";
  return "";
}

// --- The table, before the engine uses it ----------------------------------------
// The slots the engine (or the SDK's C++ wrappers every in-tree plugin uses) calls
// without a NULL check are required; the others are optional: loom_abi.h documents
// them so (NULL = not implemented / none), or every caller checks them and reports
// a clear error (the device ops, each checked by loom::Device; the collectives, by
// the engine's counting shim; the tensor-parallel operations, by
// loom::TensorParallel). A table whose struct_size ends before a required slot
// lacks it too.
//   device:   create, destroy, alloc, free, copy, stream_synchronize, ops (a table:
//             every op call reads its struct_size)
//   comm:     world_create, world_destroy, group_create, group_destroy
//   layer:    create, destroy, params, bind, forward, backward
//   optimizer: create, destroy, step, state_size, state_save, state_load
//   schedule: order
//   exec:     create, destroy, run
//   tensor-parallel: create, destroy, padded_vocab, vocab_range
//   expert-parallel: every slot (loom::ExpertParallel refuses a table without one)
// Returns "" or "<what is missing>; <what to do>".
#define LOOM_REQUIRE_SLOT(type, slot)                                                                        \
  do {                                                                                                       \
    const auto* t = static_cast<const type*>(api);                                                           \
    if (!LOOM_HAS_SLOT(t, type, slot))                                                                       \
      return "has a " #type " of struct_size " + std::to_string(t->struct_size) +                            \
             ", which ends before the required slot " #slot "; rebuild it against this SDK";                 \
    if (t->slot == nullptr)                                                                                  \
      return "leaves the required slot " #type "." #slot                                                     \
             " NULL; implement it and rebuild (only slots loom_abi.h documents as optional may be NULL)";    \
  } while (0)

std::string required_slot_problem(int32_t api_type, const void* api) {
  switch (api_type) {
    case LOOM_API_DEVICE: {
      LOOM_REQUIRE_SLOT(loom_device_api, create);
      LOOM_REQUIRE_SLOT(loom_device_api, destroy);
      LOOM_REQUIRE_SLOT(loom_device_api, alloc);
      LOOM_REQUIRE_SLOT(loom_device_api, free);
      LOOM_REQUIRE_SLOT(loom_device_api, copy);
      LOOM_REQUIRE_SLOT(loom_device_api, stream_synchronize);
      LOOM_REQUIRE_SLOT(loom_device_api, ops);
      const loom_device_ops* ops = static_cast<const loom_device_api*>(api)->ops;
      if (ops->struct_size < sizeof(uint32_t))
        return "has a loom_device_ops table of struct_size " + std::to_string(ops->struct_size) +
               "; set it to sizeof(loom_device_ops) and rebuild";
      return "";
    }
    case LOOM_API_COMM:
      LOOM_REQUIRE_SLOT(loom_comm_api, world_create);
      LOOM_REQUIRE_SLOT(loom_comm_api, world_destroy);
      LOOM_REQUIRE_SLOT(loom_comm_api, group_create);
      LOOM_REQUIRE_SLOT(loom_comm_api, group_destroy);
      return "";
    case LOOM_API_LAYER:
      LOOM_REQUIRE_SLOT(loom_layer_api, create);
      LOOM_REQUIRE_SLOT(loom_layer_api, destroy);
      LOOM_REQUIRE_SLOT(loom_layer_api, params);
      LOOM_REQUIRE_SLOT(loom_layer_api, bind);
      LOOM_REQUIRE_SLOT(loom_layer_api, forward);
      LOOM_REQUIRE_SLOT(loom_layer_api, backward);
      return "";
    case LOOM_API_OPTIMIZER:
      LOOM_REQUIRE_SLOT(loom_optimizer_api, create);
      LOOM_REQUIRE_SLOT(loom_optimizer_api, destroy);
      LOOM_REQUIRE_SLOT(loom_optimizer_api, step);
      LOOM_REQUIRE_SLOT(loom_optimizer_api, state_size);
      LOOM_REQUIRE_SLOT(loom_optimizer_api, state_save);
      LOOM_REQUIRE_SLOT(loom_optimizer_api, state_load);
      return "";
    case LOOM_API_SCHEDULE:
      LOOM_REQUIRE_SLOT(loom_schedule_api, order);
      return "";
    case LOOM_API_EXEC:
      LOOM_REQUIRE_SLOT(loom_exec_api, create);
      LOOM_REQUIRE_SLOT(loom_exec_api, destroy);
      LOOM_REQUIRE_SLOT(loom_exec_api, run);
      return "";
    case LOOM_API_TENSOR_PARALLEL:
      LOOM_REQUIRE_SLOT(loom_tensor_parallel_api, create);
      LOOM_REQUIRE_SLOT(loom_tensor_parallel_api, destroy);
      LOOM_REQUIRE_SLOT(loom_tensor_parallel_api, padded_vocab);
      LOOM_REQUIRE_SLOT(loom_tensor_parallel_api, vocab_range);
      return "";
    case LOOM_API_EXPERT_PARALLEL:
      LOOM_REQUIRE_SLOT(loom_expert_parallel_api, create);
      LOOM_REQUIRE_SLOT(loom_expert_parallel_api, destroy);
      LOOM_REQUIRE_SLOT(loom_expert_parallel_api, plan);
      LOOM_REQUIRE_SLOT(loom_expert_parallel_api, dispatch);
      LOOM_REQUIRE_SLOT(loom_expert_parallel_api, combine);
      LOOM_REQUIRE_SLOT(loom_expert_parallel_api, release);
      return "";
    default:
      return "";
  }
}
#undef LOOM_REQUIRE_SLOT

// The directories search_paths() adds next to the loom binary (never reported missing).
std::vector<std::string> default_paths() {
  std::vector<std::string> paths;
  boost::system::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    fs::path bin = exe.parent_path();
    paths.push_back((bin / LOOM_PLUGIN_REL_DIR).lexically_normal().string());
    paths.push_back((bin / "../lib/loom/plugins").lexically_normal().string());
  }
  return paths;
}

}  // namespace

template <typename T>
static const T* typed_api(const LoadedPlugin& p, int32_t want, const char* what) {
  if (p.api_type != want)
    throw PluginError(p.file + ": plugin " + p.key() + " does not provide a " + what + " table");
  return static_cast<const T*>(p.api);
}
const loom_device_api* LoadedPlugin::device() const { return typed_api<loom_device_api>(*this, LOOM_API_DEVICE, "device"); }
const loom_comm_api* LoadedPlugin::comm() const { return typed_api<loom_comm_api>(*this, LOOM_API_COMM, "comm"); }
const loom_layer_api* LoadedPlugin::layer() const { return typed_api<loom_layer_api>(*this, LOOM_API_LAYER, "layer"); }
const loom_optimizer_api* LoadedPlugin::optimizer() const { return typed_api<loom_optimizer_api>(*this, LOOM_API_OPTIMIZER, "optimizer"); }
const loom_schedule_api* LoadedPlugin::schedule() const { return typed_api<loom_schedule_api>(*this, LOOM_API_SCHEDULE, "schedule"); }
const loom_exec_api* LoadedPlugin::exec() const { return typed_api<loom_exec_api>(*this, LOOM_API_EXEC, "exec"); }
const loom_tensor_parallel_api* LoadedPlugin::tensor_parallel() const {
  return typed_api<loom_tensor_parallel_api>(*this, LOOM_API_TENSOR_PARALLEL, "tensor-parallel");
}

const void* find_service(int32_t api_type, const char* name) {
  // No name: the schema's defaults of parallel.tensor and parallel.expert (a rank
  // the engine runs has the manifest's own, RankRuntime::set_service).
  if (name == nullptr || *name == '\0') name = api_type == LOOM_API_EXPERT_PARALLEL ? "expert" : "tensor";
  const LoadedPlugin* p = registry().find("parallel", name);
  return p && p->api_type == api_type ? p->api : nullptr;
}

void Registry::load_file(const std::string& path) {
  const std::string file = fs::absolute(path).lexically_normal().string();
  // A file this registry loaded already (a search path listed again, or searched
  // again by a later plan) is the same plugins, not a second copy of them.
  boost::system::error_code same_ec;
  for (const auto& p : plugins_)
    if (p->file == file || fs::equivalent(p->file, file, same_ec)) return;
  if (const std::string problem = file_problem(file); !problem.empty())
    throw PluginError(file + ": cannot be loaded: it " + problem);
  boost::dll::shared_library lib;
  boost::system::error_code ec;
  ::dlerror();  // clear
  lib.load(file, boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_local, ec);
  if (ec || !lib.is_loaded()) {
    // dlerror() says why (Boost.DLL's own exception would append its error code's
    // text, always "Bad file descriptor", whatever the cause).
    const char* why = ::dlerror();
    std::string reason = why ? why : ec.message();
    if (reason.rfind(file + ": ", 0) == 0) reason.erase(0, file.size() + 2);  // dlerror repeats the path
    throw PluginError(file + ": cannot be loaded (" + reason +
                      "); check that it is a loom plugin built for this platform and that its "
                      "dependencies are installed");
  }

  const std::string entry = LOOM_PLUGIN_ENTRY_V1;
  if (!lib.has(entry)) {
    // Name the major it was built for when it exports another version's entry point.
    for (int major = 0; major < 100; ++major) {
      if (major == LOOM_ABI_MAJOR) continue;
      if (lib.has("loom_plugin_init_v" + std::to_string(major)))
        throw PluginError(file + ": built for loom plugin ABI " + std::to_string(major) +
                          ".x but this engine implements ABI " +
                          version_str(LOOM_ABI_MAJOR, LOOM_ABI_MINOR) +
                          "; rebuild it against the loom SDK " + std::to_string(LOOM_ABI_MAJOR) + ".x");
    }
    throw PluginError(file + ": no entry symbol " + entry +
                      "; it is not a loom plugin (build it with loom_add_plugin and LOOM_PLUGIN_LIBRARY)");
  }

  void* entry_addr = ::dlsym(lib.native(), entry.c_str());
  if (entry_addr == nullptr)
    throw PluginError(file + ": " + entry + " resolves to address 0, so it cannot be called; export the function "
                      "loom_status " + entry + "(const loom_host_api*, const loom_plugin_library**) (LOOM_PLUGIN_LIBRARY does)");
  if (const std::string problem = entry_problem(entry_addr); !problem.empty())
    throw PluginError(file + ": the entry symbol " + entry + " " + problem +
                      ", so it cannot be called; export the function loom_status " + entry +
                      "(const loom_host_api*, const loom_plugin_library**) (LOOM_PLUGIN_LIBRARY does)");
  auto& init = lib.get<loom_status(const loom_host_api*, const loom_plugin_library**)>(entry);
  const loom_plugin_library* desc = nullptr;
  loom_status st = nullptr;
  // The entry point is C: an exception thrown through it is the plugin's bug, said as
  // such for this library, not an abort of the command.
  try {
    st = init(host_api(), &desc);
  } catch (const std::exception& e) {
    throw PluginError(file + ": " + entry + " threw an exception (" + printable(e.what(), 4096) +
                      "); a plugin reports errors as a loom_status");
  } catch (...) {
    throw PluginError(file + ": " + entry + " threw an exception; a plugin reports errors as a loom_status");
  }
  if (st != nullptr) throw PluginError(file + ": plugin initialisation failed: " + take_message(st));
  if (desc == nullptr || desc->struct_size < offsetof(loom_plugin_library, num_plugins) + sizeof(size_t))
    throw PluginError(file + ": " + entry + " returned no valid library descriptor; rebuild it against this SDK");
  if (desc->abi_major != LOOM_ABI_MAJOR)
    throw PluginError(file + ": built for loom plugin ABI " + version_str(desc->abi_major, desc->abi_minor) +
                      " but this engine implements ABI " + version_str(LOOM_ABI_MAJOR, LOOM_ABI_MINOR) +
                      "; rebuild it against the loom SDK " + std::to_string(LOOM_ABI_MAJOR) + ".x");
  if (desc->abi_minor > LOOM_ABI_MINOR)
    throw PluginError(file + ": built for loom plugin ABI " + version_str(desc->abi_major, desc->abi_minor) +
                      ", newer than this engine's ABI " + version_str(LOOM_ABI_MAJOR, LOOM_ABI_MINOR) +
                      "; upgrade loom or rebuild the plugin against SDK " +
                      version_str(LOOM_ABI_MAJOR, LOOM_ABI_MINOR));
  if (desc->num_plugins > 0 && desc->plugins == nullptr)
    throw PluginError(file + ": library descriptor lists plugins but the array is NULL");
  if (desc->num_plugins == 0) throw PluginError(file + ": its library descriptor lists no plugins");

  std::vector<std::unique_ptr<LoadedPlugin>> found;
  for (size_t i = 0; i < desc->num_plugins; ++i) {
    const loom_plugin_info* info = desc->plugins[i];
    if (info == nullptr || info->struct_size < offsetof(loom_plugin_info, num_options) + sizeof(size_t))
      throw PluginError(file + ": plugin descriptor #" + std::to_string(i) + " is NULL or too small");
    auto p = std::make_unique<LoadedPlugin>();
    p->kind = info->kind ? info->kind : "";
    p->name = info->name ? info->name : "";
    p->version = printable(info->version, 64);
    p->description = printable(info->description, 4096);
    p->file = file;
    p->api_type = info->api_type;
    p->api = info->api;
    p->abi_major = desc->abi_major;
    p->abi_minor = desc->abi_minor;
    if (!valid_name(p->kind) || !valid_name(p->name))
      throw PluginError(file + ": plugin descriptor #" + std::to_string(i) + " has an invalid kind/name '" +
                        printable(p->kind.c_str(), 64) + "/" + printable(p->name.c_str(), 64) +
                        "' (up to 64 lowercase letters, digits, '_', '.', '-', starting with a letter or digit)");
    if (expected_api_type(p->kind, p->api_type) != p->api_type)
      throw PluginError(file + ": plugin " + p->key() + " declares api_type " + std::to_string(p->api_type) +
                        ", which is not a table of kind '" + p->kind +
                        "' (kinds: device, comm, layer, parallel, exec)");
    // A table kind exists from the minor that introduced it; an older library cannot mean it.
    const uint32_t introduced = p->api_type == LOOM_API_EXPERT_PARALLEL   ? 4
                                : p->api_type == LOOM_API_TENSOR_PARALLEL ? 1
                                                                          : 0;
    if (p->abi_minor < introduced)
      throw PluginError(file + ": plugin " + p->key() + " declares api_type " + std::to_string(p->api_type) +
                        ", which ABI 1." + std::to_string(introduced) + " introduced, but it was built for ABI " +
                        version_str(p->abi_major, p->abi_minor));
    if (p->api == nullptr || *static_cast<const uint32_t*>(p->api) < sizeof(uint32_t) * 2)
      throw PluginError(file + ": plugin " + p->key() + " has no API table");
    if (const std::string problem = required_slot_problem(p->api_type, p->api); !problem.empty())
      throw PluginError(file + ": plugin " + p->key() + " " + problem);
    if (info->num_options > 0 && info->options == nullptr)
      throw PluginError(file + ": plugin " + p->key() + " lists options but the array is NULL");
    for (size_t j = 0; j < info->num_options; ++j) {
      p->options.push_back(read_option(info->options, j, file + ": plugin " + p->key()));
      for (size_t k = 0; k + 1 < p->options.size(); ++k)
        if (p->options[k].name == p->options.back().name)
          throw PluginError(file + ": plugin " + p->key() + " declares option '" + p->options.back().name +
                            "' twice (#" + std::to_string(k) + " and #" + std::to_string(j) + ")");
    }
    for (const auto& q : found)
      if (q->key() == p->key())
        throw PluginError(file + ": describes plugin " + p->key() + " twice");
    found.push_back(std::move(p));
  }
  for (const auto& p : found)
    if (const LoadedPlugin* prev = find(p->kind, p->name))
      throw DuplicatePluginError("plugin " + p->key() + " is provided by both " + prev->file + " and " + file +
                                 " (which one runs would depend on the search order); remove one of them from "
                                 "the search path or rename it");

  for (auto& p : found) plugins_.push_back(std::move(p));
  loaded_libraries().push_back(std::move(lib));
}

bool Registry::searched_file_name(const std::string& filename) {
  return filename.rfind("loom_", 0) == 0 && filename.size() > 3 && filename.compare(filename.size() - 3, 3, ".so") == 0;
}

std::vector<std::string> Registry::load_dirs(const std::vector<std::string>& dirs) {
  std::vector<std::string> errors;
  auto fail = [&](const std::string& e, bool duplicate) {
    errors.push_back(e);
    load_errors_.push_back(e);
    if (duplicate) duplicate_errors_.push_back(e);
  };
  const std::vector<std::string> defaults = default_paths();
  std::set<std::string> seen_dirs;
  for (const std::string& d : dirs) {
    boost::system::error_code ec;
    fs::path dir = fs::canonical(d, ec);
    if (ec || !fs::is_directory(dir)) {
      // A directory someone named (plugins.search_paths, LOOM_PLUGIN_PATH, --plugin-path)
      // that is not there is most likely a typo: its plugins would be missing silently.
      if (std::find(defaults.begin(), defaults.end(), fs::path(d).lexically_normal().string()) == defaults.end())
        fail("plugin search path " + d + (ec ? " does not exist" : " is not a directory") +
                 "; fix plugins.search_paths, LOOM_PLUGIN_PATH or --plugin-path",
             false);
      continue;
    }
    if (!seen_dirs.insert(dir.string()).second) continue;
    std::vector<std::string> files;
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      if (searched_file_name(entry.path().filename().string())) files.push_back(entry.path().string());
    }
    std::sort(files.begin(), files.end());  // deterministic order → deterministic duplicate messages
    for (const std::string& f : files) {
      try {
        load_file(f);
      } catch (const DuplicatePluginError& e) {
        fail(e.what(), true);
      } catch (const PluginError& e) {
        fail(e.what(), false);
      }
    }
  }
  return errors;
}

const LoadedPlugin* Registry::find(const std::string& kind, const std::string& name) const {
  for (const auto& p : plugins_)
    if (p->kind == kind && p->name == name) return p.get();
  return nullptr;
}

const LoadedPlugin& Registry::get(const std::string& kind, const std::string& name) const {
  if (const LoadedPlugin* p = find(kind, name)) return *p;
  std::string available;
  for (const auto& p : plugins_)
    if (p->kind == kind) available += (available.empty() ? "" : ", ") + p->name;
  throw PluginError("no plugin " + kind + "/" + name + " is loaded (available " + kind + " plugins: " +
                    (available.empty() ? "none" : available) +
                    "); check plugins.search_paths or LOOM_PLUGIN_PATH");
}

std::vector<std::string> Registry::search_paths(const std::vector<std::string>& extra) {
  std::vector<std::string> paths = extra;
  if (const char* env = std::getenv("LOOM_PLUGIN_PATH")) {
    std::stringstream ss(env);
    std::string item;
    while (std::getline(ss, item, ':'))
      if (!item.empty()) paths.push_back(item);
  }
  for (std::string& d : default_paths()) paths.push_back(std::move(d));
  return paths;
}

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace loom::plugins
