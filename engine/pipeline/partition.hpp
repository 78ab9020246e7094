// Which layers each pipeline chunk holds. The transformer blocks are divided over
// the pp * vpp global chunks, evenly unless the manifest gives the first and/or
// last chunk its own count (pipeline.first_chunk_layers / last_chunk_layers, for
// stages that also carry the embedding or the output layer); the layers before
// the blocks (model.pre) join the first global chunk, those after (model.post)
// the last. Global chunk g lives on pipeline rank g mod pp as its local chunk
// g / pp (0-based here).
#pragma once

#include "engine/model/model.hpp"
#include "engine/topology/layer_split.hpp"

#include <vector>

namespace loom::pipeline {

// The global chunks' layers, in model order. layers: model::model_layers().
std::vector<std::vector<model::LayerSpec>> partition_layers(const std::vector<model::LayerSpec>& layers,
                                                            const std::vector<int>& blocks_per_chunk);

// The local chunks of pipeline rank `pp_rank`, as the Model takes them.
std::vector<model::ModelChunk> local_chunks(const std::vector<std::vector<model::LayerSpec>>& global_chunks, int pp,
                                            int pp_rank);

}  // namespace loom::pipeline
