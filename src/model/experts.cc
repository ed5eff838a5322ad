// A mixture-of-experts layer's MLP (families mixtral, qwen2_moe, qwen3_moe):
// the router, the experts over the tokens routed to them, the shared expert,
// and the load-balancing loss's statistics. Note [Experts], Note [Load
// balancing].
#include <ATen/ATen.h>

#include <vector>

#include "model/model.h"
#include "model/saved_activations.h"
#include "util/errors.h"

namespace strata {

// Note [Experts]
// What transformers 5.23's modeling files compute (MixtralSparseMoeBlock,
// Qwen3MoeSparseMoeBlock, Qwen2MoeSparseMoeBlock), dropless:
//   logits = m router^T                     [N, E] in the compute dtype
//   probs  = softmax(logits in fp32)        top k of them per token, and their
//   weights = the top k probabilities, divided by their sum where the family
//             renormalises (Mixtral always, Qwen by norm_topk_prob), cast
//             to the compute dtype by the Qwen routers (Mixtral keeps fp32)
//   out    = sum over a token's k experts of weight x expert(m), where
//            expert(x) = (silu(x Wg^T) * (x Wu^T)) Wd^T and gate_up = [Wg; Wu]
//   qwen2_moe adds sigmoid(m shared_gate^T) x shared_expert(m).
// The experts are the fused layout's two parameters per layer (experts.
// gate_up [E, 2I, D], experts.down [E, D, I]): one fused parameter each, so
// Adam moves an expert no token chose by its momentum and weight decay, as
// torch's AdamW does on transformers 5's fused parameters.
//
// Grouping: the N k (token, slot) copies are sorted by expert (a stable
// argsort, so the same on every device), each expert multiplies its
// contiguous rows (a loop of GEMMs, or with run.expert_gemm grouped one
// at::_grouped_mm over all of them, which needs no host copy of the per-
// expert counts), and the weighted outputs are put back in (token, slot)
// order by the inverse permutation and summed over the k slots: no
// scatter-add, so the sum's order is fixed and the layer's bits do not depend
// on atomics, threads or placement. The backward makes the routing again from
// the saved logits (the same ops on the same values: the same bits) and
// needs only the gate/up products of the copies (Saved::kExpertGateUp): the
// gradient of a routing weight, <dy, expert(x)>, is <dy Wd, silu(g) * u>,
// so the experts' down products are never kept, and a recompute from the
// layer's input skips them.

namespace {

enum : size_t { kRouterW = 6, kGateUpW = 7, kDownW = 8 };

at::Tensor rows(const at::Tensor& t) { return t.reshape({-1, t.size(-1)}); }

// Tokens per expert from the experts chosen (any shape, values in [0, e)),
// as int64 [e] on their device: searchsorted over the sorted choices, which
// every device computes the same (no atomics).
at::Tensor expert_counts(const at::Tensor& chosen, int64_t e) {
  const at::Tensor sorted = std::get<0>(at::sort(chosen.reshape({-1}), /*stable=*/true, 0, false));
  const at::Tensor bounds = at::searchsorted(sorted, at::arange(e + 1, sorted.options()));
  return bounds.narrow(0, 1, e) - bounds.narrow(0, 0, e);
}

}  // namespace

// Note [Experts]'s routing of `logits` [N, E].
struct Model::Routing {
  at::Tensor probs;     // [N, E] fp32
  at::Tensor top_idx;   // [N, k] int64
  at::Tensor top_prob;  // [N, k] fp32, before renormalising
  at::Tensor weights;   // [N, k]: fp32 (Mixtral) or the compute dtype (Qwen)
  at::Tensor order;     // [N k]: slot indexes (token * k + j) sorted by expert
  at::Tensor inverse;   // [N k]: order's inverse permutation
  at::Tensor token;     // [N k]: the token of each sorted slot
  at::Tensor counts;    // [E] int64 on the device
  std::vector<int64_t> host_counts;  // the loop's
  at::Tensor offsets;   // [E] int32: the grouped GEMM's (cumulative counts)
};

// Note [Experts]: run.expert_gemm's grouped GEMM where its rows are 16-byte
// aligned (at::_grouped_mm's condition), else the loop.
bool Model::grouped(const at::Tensor& like) const {
  const int64_t eb = int64_t(like.element_size());
  return cfg_.moe.grouped_gemm && cfg_.dim * eb % 16 == 0 && cfg_.expert_dim() * eb % 16 == 0;
}

Model::Routing Model::route(const at::Tensor& logits) const {
  const int64_t k = cfg_.moe.num_experts_per_tok, e = cfg_.moe.num_experts;
  Routing r;
  r.probs = at::softmax(logits.to(at::kFloat), -1);
  std::tie(r.top_prob, r.top_idx) = at::topk(r.probs, k, -1);
  r.weights = cfg_.moe.norm_topk_prob ? r.top_prob / r.top_prob.sum(-1, /*keepdim=*/true) : r.top_prob;
  if (cfg_.routing_weights_cast()) r.weights = r.weights.to(logits.scalar_type());
  const at::Tensor flat = r.top_idx.reshape({-1});
  r.order = at::argsort(flat, /*stable=*/true, 0, false);
  r.inverse = at::argsort(r.order, /*stable=*/true, 0, false);
  r.token = at::div(r.order, k, "floor");
  r.counts = expert_counts(flat, e);
  if (grouped(logits)) {
    r.offsets = at::cumsum(r.counts, 0).to(at::kInt);  // the grouped GEMM's row ends, on the device
  } else {
    const at::Tensor host = r.counts.cpu();  // the loop's row counts: one wait per layer on a GPU
    r.host_counts.assign(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + e);
  }
  return r;
}

// The weighted expert outputs `ys` [N k, D] (sorted order) back in token
// order and summed over each token's k slots; weights `ws` [N k] sorted.
at::Tensor Model::combine(const Routing& r, const at::Tensor& ys, const at::Tensor& ws) const {
  const int64_t k = cfg_.moe.num_experts_per_tok;
  at::Tensor weighted = cfg_.routing_weights_cast() ? ys * ws.unsqueeze(-1)
                                                    : (ys * ws.unsqueeze(-1)).to(ys.scalar_type());
  return weighted.index_select(0, r.inverse).view({-1, k, ys.size(-1)}).sum(1);
}

at::Tensor Model::moe_forward(const std::vector<at::Tensor>& w, const at::Tensor& m) const {
  const int64_t ei = cfg_.expert_dim();
  const at::Tensor m2 = rows(m);
  const Routing r = route(at::linear(m2, w[kRouterW]));
  const at::Tensor xs = m2.index_select(0, r.token);
  at::Tensor y;
  if (grouped(m2)) {
    const at::Tensor gu = at::_grouped_mm(xs, w[kGateUpW].transpose(1, 2), r.offsets);
    y = at::_grouped_mm(at::silu(gu.narrow(-1, 0, ei)) * gu.narrow(-1, ei, ei), w[kDownW].transpose(1, 2), r.offsets);
  } else {
    std::vector<at::Tensor> ys;
    int64_t off = 0;
    for (int64_t e = 0; e < cfg_.moe.num_experts; ++e) {
      const int64_t n = r.host_counts[size_t(e)];
      if (n == 0) continue;
      at::Tensor gu = at::linear(xs.narrow(0, off, n), w[kGateUpW].select(0, e));
      ys.push_back(at::linear(at::silu(gu.narrow(-1, 0, ei)) * gu.narrow(-1, ei, ei), w[kDownW].select(0, e)));
      off += n;
    }
    y = at::cat(ys);
  }
  const at::Tensor ws = r.weights.reshape({-1}).index_select(0, r.order);
  at::Tensor out = combine(r, y, ws);
  if (cfg_.shared_expert()) {
    const size_t sh = shared_index();
    const at::Tensor p = at::silu(at::linear(m2, w[sh])) * at::linear(m2, w[sh + 1]);
    out = out + at::sigmoid(at::linear(m2, w[sh + 3])) * at::linear(p, w[sh + 2]);
  }
  return out.view_as(m);
}

// Note [Load balancing]
// transformers' load_balancing_loss_func over one forward (a micro-batch):
// per layer, P = softmax(logits) in the logits' dtype and its top k; over
// all layers' N rows, f_e = (times e is chosen) / rows and p_e = (sum of
// P[:, e]) / rows; aux = E sum_e f_e p_e. The forward adds each layer's
// choices and probability sums into the micro-batch's MoeTally; once every
// layer's forward has run, the trainer has aux and its gradient, which is the
// same vector for every row of every layer: d aux / d P[n, e] = E f_e / rows
// (f is a count: no gradient). Times the coefficient and the micro-batch's
// loss scale it is LayerSaved::aux_grad, which the backward takes through
// the softmax beside the routing's own gradient.
void Model::moe_tally(const at::Tensor& logits, const Routing& r, MoeTally* t) const {
  const at::Tensor p = at::softmax(logits, -1);
  const at::Tensor chosen = std::get<1>(at::topk(p, cfg_.moe.num_experts_per_tok, -1));
  t->selected.add_(expert_counts(chosen, cfg_.moe.num_experts).to(at::kFloat));
  t->prob_sum.add_(p.to(at::kFloat).sum(0));
  t->rows += logits.size(0);
  if (t->load.defined()) t->load.add_(r.counts.to(t->load.scalar_type()));
}

at::Tensor Model::moe_saving(const std::vector<at::Tensor>& w, const at::Tensor& m, LayerSaved* s, bool output) const {
  LayerSaved& S = *s;
  const int64_t ei = cfg_.expert_dim(), k = cfg_.moe.num_experts_per_tok;
  const at::Tensor m2 = rows(m);
  const int64_t n_rows = m2.size(0);
  S[Saved::kRouterLogits] = at::linear(m2, w[kRouterW]);
  const Routing r = route(S[Saved::kRouterLogits]);
  if (output && S.tally != nullptr) moe_tally(S[Saved::kRouterLogits], r, S.tally);
  const at::Tensor xs = m2.index_select(0, r.token);
  const bool group = grouped(m2);
  at::Tensor& gu = S[Saved::kExpertGateUp];
  if (group) {
    gu = at::_grouped_mm(xs, w[kGateUpW].transpose(1, 2), r.offsets);
  } else {
    gu = at::empty({n_rows * k, 2 * ei}, m2.options());
    int64_t off = 0;
    for (int64_t e = 0; e < cfg_.moe.num_experts; ++e) {
      const int64_t n = r.host_counts[size_t(e)];
      if (n > 0) {
        at::Tensor dst = gu.narrow(0, off, n);
        at::mm_out(dst, xs.narrow(0, off, n), w[kGateUpW].select(0, e).t());
      }
      off += n;
    }
  }
  S[Saved::kExpertAct] = at::silu(gu.narrow(-1, 0, ei)) * gu.narrow(-1, ei, ei);
  if (cfg_.shared_expert()) {
    const size_t sh = shared_index();
    S[Saved::kGate] = at::linear(m2, w[sh]);
    S[Saved::kUp] = at::linear(m2, w[sh + 1]);
    S[Saved::kSwiglu] = at::silu(S[Saved::kGate]) * S[Saved::kUp];
    S[Saved::kSharedGate] = at::linear(m2, w[sh + 3]);
  }
  if (!output) return at::Tensor();  // a recompute: the down products only make the output
  at::Tensor ys;
  if (group) {
    ys = at::_grouped_mm(S[Saved::kExpertAct], w[kDownW].transpose(1, 2), r.offsets);
  } else {
    ys = at::empty({n_rows * k, m2.size(1)}, m2.options());
    int64_t off = 0;
    for (int64_t e = 0; e < cfg_.moe.num_experts; ++e) {
      const int64_t n = r.host_counts[size_t(e)];
      if (n > 0) {
        at::Tensor dst = ys.narrow(0, off, n);
        at::mm_out(dst, S[Saved::kExpertAct].narrow(0, off, n), w[kDownW].select(0, e).t());
      }
      off += n;
    }
  }
  at::Tensor out = combine(r, ys, r.weights.reshape({-1}).index_select(0, r.order));
  if (cfg_.shared_expert()) {
    const size_t sh = shared_index();
    out = out + at::sigmoid(S[Saved::kSharedGate]) * at::linear(S[Saved::kSwiglu], w[sh + 2]);
  }
  return out.view_as(m);
}

// The experts' part of the backward over the sorted copies (xs their
// inputs, dys d(output) per copy, ws their routing weights): sets *dws (each
// copy's routing-weight gradient, fp32) and, with base_grads, the experts'
// weight gradients; returns d(xs). One grouped GEMM per product, or the loop.
at::Tensor Model::experts_backward(const std::vector<at::Tensor>& w, const LayerSaved& S, const Routing& r,
                                   const at::Tensor& xs, const at::Tensor& dys, const at::Tensor& ws,
                                   at::Tensor* dws, std::vector<at::Tensor>* dw, bool base_grads) const {
  std::vector<at::Tensor>& g = *dw;
  const int64_t ei = cfg_.expert_dim(), ne = cfg_.moe.num_experts;
  const at::ScalarType dt = dys.scalar_type();
  const at::Tensor& gu = S[Saved::kExpertGateUp];
  const at::Tensor& act = S[Saved::kExpertAct];
  const bool cast = cfg_.routing_weights_cast();
  // d(weighted output) per copy: dy times its weight, in the dtype the
  // family's product has (Mixtral's weights are fp32).
  const auto weighted = [&](const at::Tensor& d, const at::Tensor& w1) {
    return cast ? d * w1 : (d * w1).to(dt);  // an fp32 w1 widens d exactly: an fp32 product
  };
  // The SwiGLU's backward: d(gate | up) from d(act).
  const auto swiglu_backward = [&](const at::Tensor& da, const at::Tensor& gu_rows) {
    const at::Tensor gate = gu_rows.narrow(-1, 0, ei), up = gu_rows.narrow(-1, ei, ei);
    return at::cat({at::silu_backward(da * up, gate), da * at::silu(gate)}, -1);
  };
  if (grouped(dys)) {
    // The same products as the loop's below, each one grouped GEMM over the
    // sorted copies. An expert without rows gets an exact zero, whatever the
    // kernel leaves in an empty group's output (on the device: no wait for
    // the counts).
    const at::Tensor w1 = ws.unsqueeze(-1);
    const at::Tensor has_rows = r.counts.gt(0).view({ne, 1, 1});
    if (base_grads) g[kDownW] = at::where(has_rows, at::_grouped_mm(weighted(dys, w1).t(), act, r.offsets), 0);
    const at::Tensor da_plain = at::_grouped_mm(dys, w[kDownW], r.offsets);
    dws->copy_((da_plain.to(at::kFloat) * act).sum(-1));
    const at::Tensor dgu = swiglu_backward(weighted(da_plain, w1), gu);
    if (base_grads) g[kGateUpW] = at::where(has_rows, at::_grouped_mm(dgu.t(), xs, r.offsets), 0);
    return at::_grouped_mm(dgu, w[kGateUpW], r.offsets);
  }
  at::Tensor dxs = at::empty_like(xs);
  if (base_grads) {
    g[kGateUpW] = at::empty_like(w[kGateUpW]);
    g[kDownW] = at::empty_like(w[kDownW]);
  }
  int64_t off = 0;
  for (int64_t e = 0; e < ne; ++e) {
    const int64_t n = r.host_counts[size_t(e)];
    if (n == 0) {  // no token: a zero gradient (Adam still moves it: Note [Experts])
      if (base_grads) {
        g[kGateUpW].select(0, e).zero_();
        g[kDownW].select(0, e).zero_();
      }
      continue;
    }
    const at::Tensor dy_e = dys.narrow(0, off, n), w_e = ws.narrow(0, off, n).unsqueeze(-1);
    const at::Tensor act_e = act.narrow(0, off, n);
    if (base_grads) {
      at::Tensor dst = g[kDownW].select(0, e);
      at::mm_out(dst, weighted(dy_e, w_e).t(), act_e);
    }
    const at::Tensor da_plain = at::mm(dy_e, w[kDownW].select(0, e));  // dy Wd: [n, I]
    dws->narrow(0, off, n).copy_((da_plain.to(at::kFloat) * act_e).sum(-1));
    const at::Tensor dgu = swiglu_backward(weighted(da_plain, w_e), gu.narrow(0, off, n));  // [n, 2I]
    if (base_grads) {
      at::Tensor dst = g[kGateUpW].select(0, e);
      at::mm_out(dst, dgu.t(), xs.narrow(0, off, n));
    }
    at::Tensor dst = dxs.narrow(0, off, n);
    at::mm_out(dst, dgu, w[kGateUpW].select(0, e));
    off += n;
  }
  return dxs;
}

// qwen2_moe's shared expert: out += sigmoid(z) x (p Ws2^T), z = m Wsg^T,
// p = silu(m Ws1^T) * (m Ws3^T). Returns dm2 plus its part of d(m).
at::Tensor Model::shared_expert_backward(const std::vector<at::Tensor>& w, LayerSaved* s, const at::Tensor& dy2,
                                         const at::Tensor& m2, const at::Tensor& dm2, std::vector<at::Tensor>* dw,
                                         bool base_grads) const {
  LayerSaved& S = *s;
  std::vector<at::Tensor>& g = *dw;
  const size_t sh = shared_index();
  const at::Tensor sig = at::sigmoid(S[Saved::kSharedGate]);  // [N, 1]
  const at::Tensor p = S[Saved::kSwiglu];
  const at::Tensor dp_plain = at::mm(dy2, w[sh + 2]);  // dy Ws2
  const at::Tensor dz = at::sigmoid_backward((dp_plain * p).sum(-1, /*keepdim=*/true), sig);
  if (base_grads) {
    g[sh + 2] = at::mm((dy2 * sig).t(), p);
    g[sh + 3] = at::mm(dz.t(), m2);
  }
  const at::Tensor dp = dp_plain * sig;
  const at::Tensor gate = S[Saved::kGate], up = S[Saved::kUp];
  const at::Tensor d_up = dp * at::silu(gate), d_gate = at::silu_backward(dp * up, gate);
  if (base_grads) {
    g[sh] = at::mm(d_gate.t(), m2);
    g[sh + 1] = at::mm(d_up.t(), m2);
  }
  for (Saved e : {Saved::kGate, Saved::kUp, Saved::kSwiglu, Saved::kSharedGate}) S[e] = at::Tensor();
  return dm2 + at::mm(d_gate, w[sh]) + at::mm(d_up, w[sh + 1]) + at::mm(dz, w[sh + 3]);
}

at::Tensor Model::moe_backward(const std::vector<at::Tensor>& w, LayerSaved* s, const at::Tensor& dy2,
                               std::vector<at::Tensor>* dw, bool base_grads) const {
  LayerSaved& S = *s;
  std::vector<at::Tensor>& g = *dw;
  const int64_t k = cfg_.moe.num_experts_per_tok;
  const at::Tensor m2 = rows(S[Saved::kMlpNormed]);
  const at::Tensor& logits = S[Saved::kRouterLogits];
  const at::ScalarType dt = dy2.scalar_type();
  const Routing r = route(logits);
  const at::Tensor xs = m2.index_select(0, r.token);
  const at::Tensor dys = dy2.index_select(0, r.token);  // the output's gradient, per sorted copy
  const at::Tensor ws = r.weights.reshape({-1}).index_select(0, r.order);
  at::Tensor dws = at::empty({xs.size(0)}, dy2.options().dtype(at::kFloat));
  const at::Tensor dxs = experts_backward(w, S, r, xs, dys, ws, &dws, dw, base_grads);
  S[Saved::kExpertGateUp] = S[Saved::kExpertAct] = at::Tensor();
  // Back to (token, slot) order; the copies of a token summed.
  at::Tensor dm2 = dxs.index_select(0, r.inverse).view({-1, k, m2.size(1)}).sum(1);
  // The routing weights' gradient through the top-k renormalisation and the
  // fp32 softmax, plus the load-balancing loss's through its own softmax.
  at::Tensor dw_top = dws.index_select(0, r.inverse).view({-1, k});
  if (cfg_.routing_weights_cast()) dw_top = dw_top.to(dt).to(at::kFloat);  // the cast's rounding of the gradient
  at::Tensor dtop = dw_top;
  if (cfg_.moe.norm_topk_prob) {
    const at::Tensor sum = r.top_prob.sum(-1, /*keepdim=*/true);
    const at::Tensor wn = r.top_prob / sum;
    dtop = (dw_top - (dw_top * wn).sum(-1, /*keepdim=*/true)) / sum;
  }
  const at::Tensor dprobs = at::zeros_like(r.probs).scatter_(1, r.top_idx, dtop);
  at::Tensor dlogits = at::_softmax_backward_data(dprobs, r.probs, -1, at::kFloat).to(dt);
  if (S.aux_grad.defined()) {
    const at::Tensor p = at::softmax(logits, -1);
    dlogits = dlogits + at::_softmax_backward_data(S.aux_grad.to(dt).expand_as(p), p, -1, dt);
  }
  if (base_grads) g[kRouterW] = at::mm(dlogits.t(), m2);
  dm2 = dm2 + at::mm(dlogits, w[kRouterW]);
  S[Saved::kRouterLogits] = at::Tensor();
  if (cfg_.shared_expert()) dm2 = shared_expert_backward(w, s, dy2, m2, dm2, dw, base_grads);
  return dm2;
}

}  // namespace strata
