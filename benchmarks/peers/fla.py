"""flash-linear-attention (PyPI fla-core): `chunk_simple_gla` and `fused_chunk_simple_gla`.

    fla.ops.simple_gla.chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                                        output_final_state=False, cu_seqlens=None, ...) -> (o, final_state)
    fla.ops.simple_gla.fused_chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, ...,
                                              cu_seqlens=None) -> (o, final_state)

q, k: [B, T, H, K], v: [B, T, H, V] (our layout). `g_gamma` [H] is the
per-head natural-log decay (fla rescales it to log2 inside), so
`g_gamma = -decay`; per-token rates go in `g` [B, T, H] (`g = -decay`, not
differentiated); without decay both are None (plain causal linear attention).
Packed rows: the varlen API takes a batch of one with `cu_seqlens` [N + 1]
(int64), so the B rows are viewed as one row of B * T tokens (a free reshape)
holding every row's sequences.
"""

from __future__ import annotations

from benchmarks import cases, worker
from benchmarks.peers import common

FUNCTIONS = {"fla-chunk": "chunk_simple_gla", "fla-fused_chunk": "fused_chunk_simple_gla"}


def make_attention(job: dict, torch):
  """f(q, k, v) -> o for one fla job."""
  from fla.ops import simple_gla  # noqa: PLC0415 -- the package is optional

  fn = getattr(simple_gla, FUNCTIONS[job["impl"]])
  rates = cases.decay_array(job)
  gate = {} if rates is None else {"g" if rates.ndim == 3 else "g_gamma": -torch.from_numpy(rates).cuda()}
  scale = job["dim_k"] ** -0.5
  if cases.segments_of(job) == 1:
    return lambda q, k, v: fn(q, k, v, **gate, scale=scale)[0]
  flat = lambda x: x.reshape(1, -1, *x.shape[2:])  # noqa: E731 -- [B, T, ...] -> [1, B * T, ...]
  gate = {name: flat(x) if x.ndim == 3 else x for name, x in gate.items()}
  cu_seqlens = torch.tensor(cases.cu_seqlens(job), dtype=torch.long, device="cuda")
  return lambda q, k, v: fn(flat(q), flat(k), flat(v), **gate, scale=scale,
                            cu_seqlens=cu_seqlens)[0].reshape(v.shape)


if __name__ == "__main__":
  worker.main(lambda: common.make_backend(make_attention, "bthd", {"einops": "einops", "fla.ops.simple_gla": "fla-core"}))
