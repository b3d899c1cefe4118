"""lightning-attn (PyPI lightning-attn, OpenNLPLab): the Lightning Attention-2 Triton kernels.

    lightning_attn.ops.lightning_attn2(q, k, v, s) -> o            # with decay
    lightning_attn.ops.lightning_attn2_no_decay(q, k, v) -> o      # without

q, k: [B, H, T, D], v: [B, H, T, E] (head-major: the inputs are made in that
layout, so no transpose is timed); `s` is the float32 [H, 1, 1] tensor of
decay rates (lambda = exp(-s), our `decay`). There is no scale argument
(scale 1). Backward: autograd (two kernels, intra- and inter-block). It takes
neither per-token rates nor packed sequences: those jobs are skipped.
"""

from __future__ import annotations

from benchmarks import cases, worker
from benchmarks.peers import common


def make_attention(job: dict, torch):
  """f(q, k, v) -> o for one lightning-attn job."""
  from lightning_attn.ops import lightning_attn2, lightning_attn2_no_decay  # noqa: PLC0415 -- optional

  rates = cases.decay_array(job)  # [H]: per-token rates are skipped (`cases.unsupported`)
  if rates is None:
    return lightning_attn2_no_decay
  s = torch.from_numpy(rates).cuda().reshape(-1, 1, 1)
  return lambda q, k, v: lightning_attn2(q, k, v, s)


if __name__ == "__main__":
  worker.main(lambda: common.make_backend(make_attention, "bhtd", {"lightning_attn.ops": "lightning-attn"}))
