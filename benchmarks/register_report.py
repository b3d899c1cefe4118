"""Registers, stack frame and spills of the delta attention kernels on sm90, from ptxas, without a GPU.

    PYTHONPATH=<triton 3.6> python -m benchmarks.register_report --form kda --dim 128 [--config chunk_size=16,...]

JAX lowers each Pallas Triton kernel of the delta op (forward and backward,
bf16, in `default_config`'s blocks for sm90 or those given) for CUDA on this
machine (`shared_memory.delta_kernels`), Triton 3.6 compiles the IR to PTX
and its bundled ptxas (`-v`, sm_90a) reports each kernel's registers, stack
frame and spill bytes: the first thing to look at where a kernel is slower
than its bytes and FLOPs say (PERFORMANCE.md, "Delta attention").
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import tempfile

import jax.numpy as jnp

from benchmarks import delta_sweep
from benchmarks import shared_memory
from lightning_jax.ops.delta_attention import pallas_triton


def ptxas_report(ir_text: str, *, num_warps: int, num_stages: int, capability: int = 90) -> str:
  """ptxas's resource lines for one kernel's Triton IR, compiled for sm<capability>a."""
  import triton  # noqa: PLC0415

  module, stages, metadata, _, _ = shared_memory.triton_gpu_module(ir_text, capability, num_warps=num_warps,
                                                                   num_stages=num_stages)
  ptx = stages["ptx"](stages["llir"](module, metadata), metadata)
  ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "kernel.ptx")
    with open(path, "w") as f:
      f.write(ptx)
    cubin = os.path.join(tmp, "kernel.cubin")
    out = subprocess.run([ptxas, "-v", "--gpu-name", f"sm_{capability}a", path, "-o", cubin],
                         capture_output=True, text=True, check=True)
  return "; ".join(line.split(":", 1)[-1].strip() for line in out.stderr.splitlines()
                   if "Used" in line or "spill" in line)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--form", choices=tuple(shared_memory.FORMS), default="kda")
  p.add_argument("--dim", type=int, default=128, help="D = padded D (E is 256)")
  p.add_argument("--config", default="", help="DeltaConfig fields over the sm90 default: field=value,...")
  args = p.parse_args(argv)
  config = pallas_triton.default_config(per_channel_gate=args.form == "kda", dtype=jnp.bfloat16, dim_k=args.dim,
                                        compute_capability=(9, 0))
  config = dataclasses.replace(config, **{k: delta_sweep.config_value(v)
                                          for k, v in (kv.split("=") for kv in args.config.split(",") if kv)})
  print(config)
  for name, kernel in shared_memory.delta_kernels(args.form, jnp.bfloat16, args.dim, config).items():
    report = ptxas_report(kernel["ir"], num_warps=kernel["num_warps"], num_stages=kernel["num_stages"])
    print(f"{name:45s} {report}", flush=True)


if __name__ == "__main__":
  main()
