#include "engine/model/layer_states.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <set>

namespace loom::model {

namespace {

// Element i of a declaration array read with the stride of its first element's
// struct_size: one of a 1.x loom_layer_state_decl's sizes (1.23's first, up to this
// header's), the members past it zero.
loom_layer_state_decl decl_at(const loom_layer_state_decl* decls, size_t i, const std::string& layer) {
  const size_t stride = decls[0].struct_size;
  constexpr size_t kSize123 = offsetof(loom_layer_state_decl, reserved_1_23) + sizeof(uint32_t);
  LOOM_REQUIRE(stride >= kSize123 && stride <= sizeof(loom_layer_state_decl) &&
                   stride % alignof(loom_layer_state_decl) == 0,
               layer << ": its state declarations have struct_size " << stride
                     << ", which no loom_layer_state_decl of ABI 1.x has (" << kSize123
                     << " since 1.23); was the layer built against another header?");
  loom_layer_state_decl d{};
  std::memcpy(&d, reinterpret_cast<const char*>(decls) + i * stride, stride);
  return d;
}

}  // namespace

std::vector<LayerState> declared_states(const loom_layer_api* api, loom_layer* handle, const std::string& instance,
                                        const std::function<void(loom_status)>& check) {
  std::vector<LayerState> out;
  if (!LOOM_HAS_SLOT(api, loom_layer_api, state) || api->state == nullptr) return out;
  const loom_layer_state_decl* decls = nullptr;
  size_t count = 0;
  check(api->state(handle, &decls, &count));
  LOOM_REQUIRE(count == 0 || decls != nullptr, instance << ": state() gave " << count << " arrays and no declarations");
  std::set<std::string> names;
  for (size_t i = 0; i < count; ++i) {
    const loom_layer_state_decl d = decl_at(decls, i, instance);
    const std::string name = d.name != nullptr ? d.name : "";
    LOOM_REQUIRE(!name.empty(), instance << ": its state array " << i << " has no name");
    LOOM_REQUIRE(names.insert(name).second, instance << " declares two state arrays named " << name
                                                     << ": names are checkpoint keys, each must be unique");
    LOOM_REQUIRE(d.count >= 1 && d.count <= (int64_t{1} << 40),
                 instance << "." << name << ": a state array of " << d.count << " elements (1 to 2^40)");
    LOOM_REQUIRE(d.data != nullptr, instance << "." << name << ": a state array without memory (data NULL)");
    LOOM_REQUIRE((d.flags & ~LOOM_LAYER_STATE_OPTIONAL) == 0,
                 instance << "." << name << ": flags " << d.flags << " has bits no ABI 1." << LOOM_ABI_MINOR
                          << " layer state has");
    out.push_back({instance + "." + name, d.data, d.count, (d.flags & LOOM_LAYER_STATE_OPTIONAL) != 0});
  }
  return out;
}

LayerStates::LayerStates(const Layers& layers) : layers_(layers) {
  for (const Layer& l : layers)
    for (LayerState& s :
         declared_states(l.api, l.handle, l.spec.instance, [&](loom_status st) { check_layer_call(st, l, "state"); })) {
      LOOM_REQUIRE(std::none_of(states_.begin(), states_.end(), [&](const LayerState& o) { return o.name == s.name; }),
                   l.spec.instance << ": its state is named " << s.name << " in checkpoints, as another layer's is");
      states_.push_back(std::move(s));
    }
}

StateValues LayerStates::snapshot() const {
  StateValues out;
  for (const LayerState& s : states_) out[s.name].assign(s.data, s.data + s.count);
  return out;
}

void LayerStates::assign(const StateValues& values, const std::string& source) const {
  for (const LayerState& s : states_) {
    const auto it = values.find(s.name);
    if (it == values.end() && s.optional) continue;
    LOOM_REQUIRE(it != values.end(), source << " holds no layer state " << s.name
                                            << ", which this model keeps (a model whose layer kept none, or another "
                                               "model)");
    LOOM_REQUIRE(static_cast<int64_t>(it->second.size()) == s.count,
                 source << ": layer state " << s.name << " has " << it->second.size() << " elements, this model's "
                        << s.count);
    for (size_t i = 0; i < it->second.size(); ++i)
      LOOM_REQUIRE(std::isfinite(it->second[i]), source << ": layer state " << s.name << " holds " << it->second[i]
                                                        << " at element " << i << "; the values must be finite");
    std::memcpy(s.data, it->second.data(), it->second.size() * sizeof(float));
  }
}

void LayerStates::end_step(runtime::RankRuntime& rank, int64_t step, int32_t microbatches) const {
  loom_layer_step_end_args a = loom::make<loom_layer_step_end_args>();
  a.step = step;
  a.microbatches = microbatches;
  for (const Layer& l : layers_)
    if (LOOM_HAS_SLOT(l.api, loom_layer_api, end_step) && l.api->end_step != nullptr)
      check_layer_call(l.api->end_step(l.handle, &rank, &a), l, "end_step");
}

}  // namespace loom::model
