// Sampler for the C++ runners: temperature, top-k, top-p (nucleus) and llama2.c's xorshift random numbers.
// Semantics follow generate.py's logits_to_probs(): logits / temperature, top-k keeps the logits >= the k-th largest,
// softmax, top-p keeps the smallest prefix of the sorted probabilities whose mass reaches p. Temperature 0 is argmax
// (the first maximum, as torch.argmax) and matches generate.py exactly; random draws use a different generator than
// torch.multinomial, so sampled text differs from generate.py's for the same seed.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace llm {

class Sampler {
 public:
  float temperature = 1.0f, top_p = 0.9f;
  int top_k = 0;

  Sampler(float temperature_, float top_p_, int top_k_, uint64_t seed)
      : temperature(temperature_), top_p(top_p_), top_k(top_k_), state_(seed ? seed : 0x9E3779B97F4A7C15ull) {}

  int sample(const float* logits, int n) {
    if (temperature <= 0.0f) return argmax(logits, n);
    probs_.resize(n);
    const float t = std::max(temperature, 1e-5f);
    for (int i = 0; i < n; i++) probs_[i] = logits[i] / t;
    if (top_k > 0 && top_k < n) {
      tmp_.assign(probs_.begin(), probs_.end());
      std::nth_element(tmp_.begin(), tmp_.begin() + (top_k - 1), tmp_.end(), std::greater<float>());
      const float kth = tmp_[top_k - 1];
      for (int i = 0; i < n; i++)
        if (probs_[i] < kth) probs_[i] = -INFINITY;
    }
    float mx = -INFINITY;
    for (int i = 0; i < n; i++) mx = std::max(mx, probs_[i]);
    double sum = 0;
    for (int i = 0; i < n; i++) sum += (probs_[i] = std::exp(probs_[i] - mx));
    for (int i = 0; i < n; i++) probs_[i] = float(probs_[i] / sum);
    const float coin = random_f32();
    if (top_p > 0.0f && top_p < 1.0f) {
      idx_.resize(n);
      std::iota(idx_.begin(), idx_.end(), 0);
      std::sort(idx_.begin(), idx_.end(), [&](int a, int b) { return probs_[a] > probs_[b]; });
      double before = 0;  // mass of the tokens ranked above this one
      int keep = 0;
      for (; keep < n && before <= top_p; keep++) before += probs_[idx_[keep]];
      double r = coin * before, cdf = 0;
      for (int j = 0; j < keep; j++) {
        cdf += probs_[idx_[j]];
        if (r < cdf) return idx_[j];
      }
      return idx_[keep - 1];
    }
    double cdf = 0;
    for (int i = 0; i < n; i++) {
      cdf += probs_[i];
      if (coin < cdf) return i;
    }
    return n - 1;
  }

  static int argmax(const float* v, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
      if (v[i] > v[best]) best = i;
    return best;
  }

 private:
  uint64_t state_;
  std::vector<float> probs_, tmp_;
  std::vector<int> idx_;

  uint32_t random_u32() {  // xorshift* (llama2.c)
    state_ ^= state_ >> 12;
    state_ ^= state_ << 25;
    state_ ^= state_ >> 27;
    return uint32_t((state_ * 0x2545F4914F6CDD1Dull) >> 32);
  }
  float random_f32() { return (random_u32() >> 8) / 16777216.0f; }
};

}  // namespace llm
