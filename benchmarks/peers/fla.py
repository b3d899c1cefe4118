"""flash-linear-attention (PyPI fla-core): `chunk_simple_gla` and `fused_chunk_simple_gla`; the delta forms'
`chunk_delta_rule`, `chunk_gated_delta_rule` and `chunk_kda`.

    fla.ops.simple_gla.chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                                        output_final_state=False, cu_seqlens=None, ...) -> (o, final_state)
    fla.ops.simple_gla.fused_chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, ...,
                                              cu_seqlens=None) -> (o, final_state)
    fla.ops.delta_rule.chunk_delta_rule(q, k, v, beta, scale=None, ..., cu_seqlens=None) -> (o, final_state)
    fla.ops.gated_delta_rule.chunk_gated_delta_rule(q, k, v, g, beta, scale=None, ..., cu_seqlens=None)
    fla.ops.kda.chunk_kda(q, k, v, g, beta, scale=None, ..., cu_seqlens=None)

q, k: [B, T, H, K], v: [B, T, H, V] (our layout). `g_gamma` [H] is the
per-head natural-log decay (fla rescales it to log2 inside), so
`g_gamma = -decay`; per-token rates go in `g` [B, T, H] (`g = -decay`, not
differentiated); without decay both are None (plain causal linear attention).
The delta forms take `beta` [B, T, H] and `g = -decay` ([B, T, H], KDA
[B, T, H, K]), not differentiated either (fla computes their gradients anyway).
Packed rows: the varlen API takes a batch of one with `cu_seqlens` [N + 1]
(int64), so the B rows are viewed as one row of B * T tokens (a free reshape)
holding every row's sequences; with per-sequence states (`cases.states_of`)
also `initial_state` [N, H, K, V] and `output_final_state=True`.

fla refuses some cases at run time; those are reported skipped with its message
(`REFUSALS`), e.g. the backward of the gated kernels on Hopper with Triton
>= 3.4.0 and < 3.7.1 ("... produces incorrect results for gated chunk_bwd_dqkwg").
"""

from __future__ import annotations

import importlib

from benchmarks import cases, worker
from benchmarks.peers import common

FUNCTIONS = {"fla-chunk": "simple_gla.chunk_simple_gla", "fla-fused_chunk": "simple_gla.fused_chunk_simple_gla"}
DELTA_FUNCTIONS = {"deltanet": "delta_rule.chunk_delta_rule",
                   "gated_deltanet": "gated_delta_rule.chunk_gated_delta_rule", "kda": "kda.chunk_kda"}
# Fragments of the messages of fla's refusals: its Triton-version check and its float32 assertions.
REFUSALS = ("produces incorrect results", "does not support float32")


def _function(job: dict):
  module, name = (DELTA_FUNCTIONS[job["decay"]] if cases.is_delta(job) else FUNCTIONS[job["impl"]]).split(".")
  return getattr(importlib.import_module(f"fla.ops.{module}"), name)  # the package is optional


def _gates(job: dict, torch) -> dict:
  """fla's gate arguments: beta and g = -decay of a delta form, g_gamma [H] or g [B, T, H] = -decay, or none."""
  tensor = lambda x: torch.from_numpy(x).cuda()  # noqa: E731
  if cases.is_delta(job):
    gates = cases.delta_gates(job)
    return {"beta": tensor(gates["beta"]), **({"g": -tensor(gates["decay"])} if "decay" in gates else {})}
  rates = cases.decay_array(job)
  return {} if rates is None else {"g" if rates.ndim == 3 else "g_gamma": -tensor(rates)}


def make_attention(job: dict, torch):
  """f(q, k, v) -> o for one fla job."""
  fn, gates = _function(job), _gates(job, torch)
  scale = job["dim_k"] ** -0.5
  if cases.segments_of(job) == 1:
    return lambda q, k, v: fn(q, k, v, **gates, scale=scale)[0]
  flat = lambda x: x.reshape(1, -1, *x.shape[2:])  # noqa: E731 -- [B, T, ...] -> [1, B * T, ...]
  gates = {name: flat(x) if x.ndim >= 3 else x for name, x in gates.items()}  # the per-token gates
  cu_seqlens = torch.tensor(cases.cu_seqlens(job), dtype=torch.long, device="cuda")
  if cases.states_of(job):
    gates.update(initial_state=torch.from_numpy(cases.sequence_states(job)).cuda(), output_final_state=True)
  return lambda q, k, v: fn(flat(q), flat(k), flat(v), **gates, scale=scale,
                            cu_seqlens=cu_seqlens)[0].reshape(v.shape)


if __name__ == "__main__":
  worker.main(lambda: common.make_backend(make_attention, "bthd",
                                          {"einops": "einops", "fla.ops.simple_gla": "fla-core"}, REFUSALS))
