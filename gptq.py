# GPTQ (Frantar et al. 2022) for quantize.py's int4 modes, gpt-fast's GPTQ.py in a few functions: int4-gptq, and
# 8da4w with --calibration_file. quantize.quantize_model calls it; the int4 grid (group_params, _int4_round), the
# storage and the modules it swaps in are qops.py's.
import math
import sys
import time

import torch
import torch.nn as nn
from torch import Tensor

from qops import QuantizedLinear, QuantizedWeight, _int4_round, _int4_values, group_params


def gptq_quantize(W: Tensor, H: Tensor, scheme: dict, act_order: bool = False, damp: float = 0.1,
                  blocksize: int = 128) -> dict:
    """GPTQ for one [N, K] weight given the Hessian H = 2 X^T X / n of its inputs [n, K]: columns are rounded one at a
    time and each rounding error is spread over the not-yet-rounded columns by the inverse Hessian. Groupwise int4
    with the same storage as round-to-nearest (groups of contiguous input columns); with act_order, columns go in
    decreasing Hessian-diagonal order and each group's scale/zero comes from the unmodified weights ("static groups"),
    so the stored layout stays the same. Returns quantize_tensor's {"q", "scales", "zeros"}."""
    G, sym = scheme["groupsize"], scheme["symmetric"]
    W = W.detach().float().clone()
    H = H.float().clone()
    N, K = W.shape
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    scales = torch.zeros(N, K // G, device=W.device)
    zeros = None if sym else torch.zeros(N, K // G, device=W.device)
    perm = None
    if act_order:
        s0, z0 = group_params(W, scheme)
        scales.copy_(s0)
        if zeros is not None:
            zeros.copy_(z0)
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    H += damp * torch.mean(torch.diag(H)) * torch.eye(K, device=H.device)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    Q = torch.zeros_like(W)
    bs = max(blocksize // G, 1) * G
    for i1 in range(0, K, bs):
        i2 = min(i1 + bs, K)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            col = i1 + i
            if act_order:
                g = int(perm[col]) // G
            else:
                g = col // G
                if col % G == 0:  # group parameters from the weights as updated so far
                    s, z = group_params(W1[:, i:i + G], scheme)
                    scales[:, g] = s[:, 0]
                    if zeros is not None:
                        zeros[:, g] = z[:, 0]
            s = scales[:, g]
            z = None if zeros is None else zeros[:, g]
            w = W1[:, i]
            q = _int4_round(w[:, None], s, z)[:, 0]
            Q[:, col] = q
            err = (w - _int4_values(q[:, None], s, z)[:, 0]) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    if act_order:
        Q = Q[:, torch.argsort(perm)]
    return {"q": Q, "scales": scales, "zeros": zeros}


def calibration_batches(calibration_ids, seq_len: int) -> Tensor:
    """Token ids (1-D: cut into rows of seq_len, or one short row) or an [n, seq_len] tensor -> [n, seq_len]."""
    ids = torch.as_tensor(calibration_ids, dtype=torch.long)
    if ids.dim() == 2:
        return ids
    if ids.dim() != 1 or ids.numel() < 2:
        raise ValueError("calibration_ids must be a list of token ids (at least 2) or a [n, seq_len] tensor")
    n = ids.numel() // seq_len
    return ids[: n * seq_len].view(n, seq_len) if n else ids.view(1, -1)


class _Stop(Exception):
    pass


class _HessianHook:
    """Forward hook accumulating H = 2 X^T X / n over a linear's inputs X (running mean)."""

    def __init__(self, K: int, device):
        self.H = torch.zeros(K, K, device=device)
        self.n = 0

    def __call__(self, module, inputs, output):
        x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
        m = x.shape[0]
        self.H *= self.n / (self.n + m)
        self.n += m
        x = x * math.sqrt(2 / self.n)
        self.H += x.T @ x


def gptq_model(model, recipe, targets, calib: Tensor, act_order=False, damp=0.1, batch=4, log=True):
    """Layer by layer: collect each linear's input Hessian on the calibration tokens [n, L] (inputs computed with the
    layers before it already quantized), GPTQ all the target linears of the layer, then run the quantized layer to get
    the next layer's inputs. An untied output projection is done last, on the final norm's output."""
    device = model.norm.weight.device
    calib = calib.to(device)
    n, L = calib.shape
    prev = (model.max_batch_size, model.max_seq_length)
    model.setup_caches(min(batch, n), L)
    pos = torch.arange(L, device=device)
    inputs = []

    def grab(mod, args, kwargs):
        inputs.append((args, kwargs))
        raise _Stop

    h = model.layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for i in range(0, n, batch):
            try:
                model(calib[i:i + batch], pos)
            except _Stop:
                pass
    finally:
        h.remove()
    t0 = time.perf_counter()
    wanted = set(targets)

    def run(mod, inputs):
        return [mod(*a, **k) for a, k in inputs]

    def gptq_modules(root, prefix, inputs, call):
        lins = {n: m for n, m in root.named_modules() if isinstance(m, nn.Linear) and f"{prefix}{n}" in wanted}
        hooks = {n: _HessianHook(m.in_features, device) for n, m in lins.items()}
        handles = [lins[n].register_forward_hook(hk) for n, hk in hooks.items()]
        try:
            call(inputs)
        finally:
            for hd in handles:
                hd.remove()
        for n, m in lins.items():
            qt = gptq_quantize(m.weight, hooks[n].H, recipe["linear"], act_order=act_order, damp=damp)
            qw = QuantizedWeight.from_quantized(qt, recipe["linear"], m.weight.dtype)
            parent, _, attr = n.rpartition(".")
            setattr(root.get_submodule(parent), attr, QuantizedLinear(qw, m.bias, recipe["act"]))

    for li, layer in enumerate(model.layers):
        gptq_modules(layer, f"layers.{li}.", inputs, lambda inp: run(layer, inp))
        outs = run(layer, inputs)
        inputs = [((o,) + tuple(a[1:]), k) for o, (a, k) in zip(outs, inputs)]
        if log:
            print(f"\rGPTQ: layer {li + 1}/{len(model.layers)} ({time.perf_counter() - t0:.0f} s)", end="",
                  file=sys.stderr, flush=True)
    if "output" in wanted and isinstance(model.output, nn.Linear):
        gptq_modules(model, "", [((model.norm(a[0]),), {}) for a, _ in inputs], lambda inp: run(model.output, inp))
    if log:
        print(file=sys.stderr)
    for layer in model.layers:
        layer.attention.kv_cache = None
    model.max_batch_size, model.max_seq_length = -1, -1
    if prev[1] > 0:
        model.setup_caches(*prev)
