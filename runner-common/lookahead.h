// Lookahead decoding (-M lookahead) for both runners: speculative.py's lookahead_generate, step for step (the same
// first guesses, pool, layout and verification, so both take the same number of forwards). Greedy and lossless: the
// text is plain greedy decoding's. Included by runner.h.
//
// Every call goes to Model::forward_masked (the exported `lookahead` program): n tokens at their positions, token k
// writing cache slot positions[0] + k, attending as an additive mask [n, S] says. The prompt is one call with a causal
// mask. A step's call holds
//   * the tokens a candidate got accepted with last step (their keys/values sat in that step's scratch slots, not
//     at their positions): fed again, a causal chain at their positions;
//   * the current token at position p;
//   * the lookahead branch: W columns x (levels) guesses, level j of column i at position p + i + j, attending to
//     the current token, level 0 of columns 1..i and levels 1..j of its own column (Jacobi trajectories);
//   * the verification branch: up to G n-grams from the pool that start with the current token, causal chains at
//     p + 1 ...
// All of them see the committed cache (slots 0 .. committed-1). The greedy token after the current one is always
// kept; a candidate that matches the greedy tokens predicted along it adds up to N - 1 more. The last level's outputs
// become the next level; each column then yields an n-gram. The pool also takes the prompt's and the text's n-grams.
// Near the context end, where a step's call would not fit the cache, a step is a plain causal call.
#pragma once

#include <algorithm>
#include <deque>
#include <limits>
#include <map>
#include <vector>

namespace llm {

struct LookaheadPool {
  int N, G;
  std::map<int, std::deque<std::vector<int>>> grams;  // first token -> up to G tails (N - 1 tokens), oldest first

  void add(const int* gram) {
    auto& lst = grams[gram[0]];
    std::vector<int> tail(gram + 1, gram + N);
    auto it = std::find(lst.begin(), lst.end(), tail);
    if (it != lst.end()) lst.erase(it);  // move to the back: the most recently seen survive the cap
    lst.push_back(tail);
    if (int(lst.size()) > G) lst.pop_front();
  }
};

inline int argmax_row(const float* row, int V) { return int(std::max_element(row, row + V) - row); }

inline std::vector<int> lookahead_generate(Model& model, const Tokenizer& tok, const std::vector<int64_t>& prompt64,
                                           int start_pos, int max_new, int N, int W, int G,
                                           const std::function<void(int)>& on_token, GenStats* st) {
  const ModelInfo& mi = model.info();
  const int S = mi.max_seq_len, V = mi.vocab_size, L = int(prompt64.size());
  const float NEG = -std::numeric_limits<float>::infinity();
  std::vector<int> seq(prompt64.begin(), prompt64.end());  // the text of this call; seq[k] sits at start_pos + k
  LookaheadPool pool{N, G, {}};
  for (int i = 0; i + N <= L; i++) pool.add(&seq[i]);
  std::vector<std::vector<int>> levels(1, std::vector<int>(W));
  for (int i = 0; i < W; i++) levels[0][i] = seq[(((L - W + i) % L) + L) % L];

  std::vector<int64_t> tokens, positions;
  std::vector<float> mask;
  // one call: tokens at positions, rows of allowed slot ranges set by the caller through `open`
  auto call = [&](int T) { return model.forward_masked(tokens.data(), positions.data(), mask.data(), T); };
  auto causal = [&](int from, int to) {  // seq[from..to] at their positions, causal over the cache
    tokens.assign(seq.begin() + from, seq.begin() + to + 1);
    const int T = to - from + 1;
    positions.resize(T);
    mask.assign(size_t(T) * S, NEG);
    for (int k = 0; k < T; k++) {
      positions[k] = start_pos + from + k;
      std::fill(mask.begin() + size_t(k) * S, mask.begin() + size_t(k) * S + start_pos + from + k + 1, 0.0f);
    }
    return call(T) + size_t(T - 1) * V;  // the last row
  };

  KeptTokens kept{tok, max_new, on_token};
  const std::vector<int>& out = kept.out;
  const double t0 = now_s();
  int cur = argmax_row(causal(0, L - 1), V);
  seq.push_back(cur);
  int committed = L;  // seq[0..committed) have their keys/values in the cache, at their positions
  kept.put(cur);
  const double t_first = now_s(), c_first = cpu_s();
  int steps = 0;
  while (!kept.done) {
    const int p = int(seq.size()) - 1;  // index of the current token
    const int r = p - committed;        // tokens fed again
    const int depth = std::min(N - 1, max_new - int(out.size()) - 1);
    std::vector<const std::vector<int>*> cands;
    if (depth > 0) {
      auto it = pool.grams.find(cur);
      if (it != pool.grams.end())
        for (const auto& c : it->second) cands.push_back(&c);  // at most G, oldest first (as Python's [-G:])
    }
    const int nl = int(levels.size());
    int Tp = nl * W;  // the current token, the lookahead branch, then the candidates
    for (auto* c : cands) Tp += std::min(depth, int(c->size()));
    const int T = r + Tp;
    std::vector<int> accepted;
    steps++;
    if (start_pos + committed + T > S) {  // no room for the guesses near the context end: a plain step
      accepted.push_back(argmax_row(causal(committed, p), V));
    } else {
      const int pos_p = start_pos + p, slot0 = start_pos + committed;
      tokens.assign(seq.begin() + committed, seq.end());
      for (int i = 1; i < W; i++) tokens.push_back(levels[0][i]);
      for (int j = 1; j < nl; j++) tokens.insert(tokens.end(), levels[j].begin(), levels[j].end());
      positions.resize(T);
      mask.assign(size_t(T) * S, NEG);
      auto open = [&](int row, int a, int b) {  // slots [a, b) visible to the call's row
        std::fill(mask.begin() + size_t(row) * S + a, mask.begin() + size_t(row) * S + b, 0.0f);
      };
      for (int k = 0; k <= r; k++) {  // fed-again tokens and the current one: causal
        positions[k] = slot0 + k;
        open(k, 0, slot0 + k + 1);
      }
      // the scratch tokens (index t >= 1 relative to the current token, call row r + t, slot pos_p + t)
      auto scratch_row = [&](int t, int offset) {
        positions[r + t] = pos_p + offset;
        open(r + t, 0, pos_p + 1);
      };
      for (int j = 0; j < nl; j++)
        for (int i = (j == 0 ? 1 : 0); i < W; i++) {
          const int t = j * W + i;
          scratch_row(t, i + j);
          for (int s = 1; s <= i; s++) open(r + t, pos_p + s, pos_p + s + 1);      // level 0, columns 1..i
          for (int jj = 1; jj <= j; jj++) open(r + t, pos_p + jj * W + i, pos_p + jj * W + i + 1);  // own column
        }
      std::vector<std::vector<int>> cidx;
      int t = nl * W;
      for (auto* c : cands) {
        std::vector<int> ids;
        const int n = std::min(depth, int(c->size()));
        for (int m = 0; m < n; m++, t++) {
          tokens.push_back((*c)[m]);
          ids.push_back(t);
          scratch_row(t, m + 1);
          for (int q : ids) open(r + t, pos_p + q, pos_p + q + 1);
        }
        cidx.push_back(ids);
      }
      const float* logits = call(T) + size_t(r) * V;  // rows from the current token on
      auto nxt = [&](int t) { return argmax_row(logits + size_t(t) * V, V); };
      accepted.push_back(nxt(0));
      std::vector<int> active(cands.size());
      for (size_t c = 0; c < cands.size(); c++) active[c] = int(c);
      for (int m = 0; m < depth; m++) {
        std::vector<int> still;
        for (int c : active)
          if (int(cidx[c].size()) > m && (*cands[c])[m] == accepted.back()) still.push_back(c);
        active.swap(still);
        if (active.empty()) break;
        accepted.push_back(nxt(cidx[active[0]][m]));
      }
      std::vector<int> outs(W);
      for (int i = 0; i < W; i++) outs[i] = nxt((nl - 1) * W + i);
      if (nl < N - 1) {
        levels.push_back(outs);
      } else {
        std::vector<int> gram(N);
        for (int i = 0; i < W; i++) {
          for (int j = 0; j < N - 1; j++) gram[j] = levels[j][i];
          gram[N - 1] = outs[i];
          pool.add(gram.data());
        }
        levels.erase(levels.begin());
        levels.push_back(outs);
      }
    }
    committed = p + 1;
    const int v = int(accepted.size());
    for (int a : accepted) kept.put(a);
    seq.insert(seq.end(), accepted.begin(), accepted.end());
    for (int e = std::max(int(seq.size()) - v + 1, N); e <= int(seq.size()); e++) pool.add(&seq[e - N]);
    cur = seq.back();
  }
  fill_stats(st, L, t0, t_first, c_first, steps, std::max(int(out.size()) - 1, 0), int(out.size()));
  return kept.out;
}

}  // namespace llm
