"""flash-linear-attention (PyPI fla-core): `chunk_simple_gla` and `fused_chunk_simple_gla`.

    fla.ops.simple_gla.chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                                        output_final_state=False, ...) -> (o, final_state)
    fla.ops.simple_gla.fused_chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, ...) -> (o, final_state)

q, k: [B, T, H, K], v: [B, T, H, V] (our layout). `g_gamma` [H] is the
per-head natural-log decay (fla rescales it to log2 inside), so
`g_gamma = -decay`; without decay it is None (plain causal linear attention).
"""

from __future__ import annotations

from benchmarks import cases, worker
from benchmarks.peers import common

FUNCTIONS = {"fla-chunk": "chunk_simple_gla", "fla-fused_chunk": "fused_chunk_simple_gla"}


def make_attention(job: dict, torch):
  """f(q, k, v) -> o for one fla job."""
  from fla.ops import simple_gla  # noqa: PLC0415 -- the package is optional

  fn = getattr(simple_gla, FUNCTIONS[job["impl"]])
  g_gamma = (-torch.tensor(cases.decay_rates(job["heads"]), dtype=torch.float32, device="cuda")
             if job["decay"] else None)
  scale = job["dim_k"] ** -0.5
  return lambda q, k, v: fn(q, k, v, g_gamma=g_gamma, scale=scale)[0]


if __name__ == "__main__":
  worker.main(lambda: common.make_backend(make_attention, "bthd", {"einops": "einops", "fla.ops.simple_gla": "fla-core"}))
