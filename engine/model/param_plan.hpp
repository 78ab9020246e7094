// Which parameters a rank holds, from its layers' declarations: the collection and
// layout the model's ParamBuffers, the memory plan (train/memory_plan.hpp) and
// resharding on resume share (one place for the tie/dedupe and local-shape rules).
#pragma once

#include "engine/model/buffer_layout.hpp"

#include <loom/loom_abi.h>

#include <cstdint>
#include <string>
#include <vector>

namespace loom::model {

// A parameter of this rank as the optimizer sees it; tied parameters appear once.
struct ParamEntry {
  std::string name;                // "blocks.0.attention.qkv.weight" (entries are in model order)
  std::vector<int64_t> full_shape, local_shape;
  size_t offset = 0, numel = 0;    // in elements, in the flat buffers
  int layer = 0;                   // index into the model's layers of the owner
  int chunk = 0;                   // local chunk of the owner
  loom_param_decl decl{};          // as declared (pointers valid while the layer lives)
  bool duplicated = false;         // identical on every tp rank
  bool expert = false;             // dim 0 split over ep, reduced over edp (loom_param_decl.expert)
  std::string tie_key;
  bool shared_across_stages = false;  // tied to a copy on another pipeline stage (embedding group)
};

// One parameter declaration of a layer, in model order.
struct DeclRef {
  int layer = 0;   // index of the declaring layer
  int index = 0;   // index in that layer's declarations
  loom_param_decl decl{};
};

struct CollectedParams {
  std::vector<DeclRef> decls;       // every declaration, model order
  std::vector<ParamEntry> entries;  // one per parameter (tied ones once); offset left 0
  std::vector<size_t> entry_of;     // decls[k] -> index into entries
};

// Declaration i of a layer's array as this engine's loom_param_decl. The array is
// read with the stride of its first element's struct_size, so a 1.0-1.3 layer's
// shorter elements read correctly and members it lacks (1.4's expert) are 0.
// Throws loom::Error naming `layer` for a struct_size no 1.x declaration has.
loom_param_decl param_decl_at(const loom_param_decl* decls, size_t i, const std::string& layer);

// A layer's `count` declarations (as its params() gave them) read with param_decl_at and
// checked before anything is sized from them: each named, uniquely in the layer, 1-4
// dims of at least 1 and at most 2^48 elements in all, a partition dim among its dims
// (or -1), a finite init_std >= 0. Throws loom::Error naming `layer` and what is wrong.
std::vector<loom_param_decl> checked_param_decls(const loom_param_decl* decls, size_t count, const std::string& layer);

// The entries of a rank from its layers' declarations (decls[li] / counts[li] as
// returned by layer li's params()), named "<instance>.<decl name>". A tied
// declaration (same tie_key) after the first shares the first's entry; shapes are
// the local ones: an expert parameter's dim 0 split over ep (ABI 1.4), then
// partition_dim over etp (0 = tp; etp differs from tp only when the run folds MoE
// parallelism), every other parameter's partition_dim over tp. Throws loom::Error
// for bad ndim, mismatched tied shapes or an expert dimension that does not split
// over ep.
CollectedParams collect_param_entries(const std::vector<std::string>& instances,
                                      const std::vector<const loom_param_decl*>& decls,
                                      const std::vector<size_t>& counts, int tp_size, int ep_size = 1,
                                      int etp_size = 0);

// Sets each entry's chunk (the local chunk of its layer, chunk_of_layer) and marks
// the tied entries whose other declaration is on another pipeline stage
// (shared_across_stages; kept in sync over the embedding group, which joins the
// first and the last global chunk: a tie from any other chunk throws loom::Error).
// chunk_global_index[c] is local chunk c's global index, of num_global chunks.
void place_entries_in_chunks(CollectedParams& c, const std::vector<int>& chunk_of_layer,
                             const std::vector<int>& chunk_global_index, int num_global);

// The buffer layout of a rank's entries (Megatron's rules per chunk, expert
// parameters in one region after every chunk's; layout_model_buffer). The Model,
// the memory planner and resharding on resume all lay out through this.
BufferLayout layout_entries(const std::vector<ParamEntry>& entries, size_t chunks, int dp, size_t bucket_size);


}  // namespace loom::model
