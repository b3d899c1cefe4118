"""Times what one device of sequence parallelism runs, on one device, against the plain op.

    python -m benchmarks.sequence_pieces [--shape 1x131072x32x128] [--states-blocks 64x64x4x3,128x128x8x2]
    python -m benchmarks.sequence_pieces --trace-devices 2 --out-dir DIR   # where the time goes on 2 devices

A device of `sequence_axis` runs, per local slice of T (`sequence_parallel`):
forward, the slice's own state (a states pass over k, v) then the op from its
prefix state; forward+backward, also a reverse states pass over q, do and the
op's backward from a final-state cotangent. This times each of those programs
(bf16, the fixed ALiBi rates, impl="pallas", the VJP with respect to q, k, v)
beside the plain op's forward and forward+backward, so that the sums

    forward:          states + prefix_fwd
    forward+backward: states + states_reverse + prefix_fwdbwd

give the device's compute before any exchange (the all-gathers move [B, H, D,
E] float32 states). Every program runs with each states-pass block config of
`--states-blocks` (block_d x block_e x warps x stages of `ChunkStatesConfig`;
"default" is the heuristics' choice), which the plain op's own sequence split
uses too where few (batch, head) pairs would leave the GPU idle.

With `--trace-devices N` it instead runs the sequence-parallel forward and
forward+backward of N devices (T N tokens over a mesh ("sp",)) under
`jax.profiler`, and prints each device's time per kernel per call from the
Perfetto trace (written under `--out-dir`): the local kernels against the
collectives.
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import kernel_times
from benchmarks import pieces
import lightning_jax as lj
from lightning_jax.ops.lightning_attention import api
from lightning_jax.ops.lightning_attention import heuristics
from lightning_jax.ops.lightning_attention.config import ChunkStatesConfig
from lightning_jax.ops.lightning_attention.config import LightningConfig


def _inputs(shape, seed):
  b, t, h, d = shape
  keys = jax.random.split(jax.random.key(seed), 6)
  q, k, v, do = (jax.random.normal(key, (b, t, h, d), jnp.bfloat16) for key in keys[:4])
  prefix, d_final = (jax.random.normal(key, (b, h, d, d), jnp.float32) for key in keys[4:])
  return q, k, v, do, prefix, d_final


def _states_config(text):
  if text == "default":
    return None
  bd, be, warps, stages = (int(x) for x in text.split("x"))
  return LightningConfig(chunk_states=ChunkStatesConfig(block_d=bd, block_e=be, num_warps=warps, num_stages=stages))


def programs(decay, states_blocks):
  """{name[blocks]: fn(q, k, v, do, prefix, d_final)}: the plain op's and one sequence-parallel device's programs,
  with each states-pass config (which the plain op's own sequence split uses too)."""
  def op(q, k, v, blocks, **kwargs):
    return lj.lightning_attention(q, k, v, decay, impl="pallas", config=_states_config(blocks), **kwargs)

  def fwdbwd(q, k, v, cotangents, blocks, **kwargs):
    # o is returned: the VJP's residuals are the inputs, so XLA would drop an unused forward.
    o, vjp = jax.vjp(lambda q, k, v: op(q, k, v, blocks, **kwargs), q, k, v)
    return o, vjp(cotangents)

  def states(y, z, blocks, reverse):
    device = heuristics.device_of(y)
    interpret = api.pallas_interpret(None, heuristics.compute_capability(device), y)
    return api._slice_state(y, z, decay, None, reverse, scale=float(y.shape[-1] ** -0.5), impl="pallas",  # noqa: SLF001
                            config=_states_config(blocks), interpret=interpret, device=device)

  found = {}
  for b in states_blocks:
    found.update({
        f"fwd[{b}]": lambda q, k, v, do, prefix, d_final, b=b: op(q, k, v, b),
        f"fwdbwd[{b}]": lambda q, k, v, do, prefix, d_final, b=b: fwdbwd(q, k, v, do, b),
        f"prefix_fwd[{b}]": lambda q, k, v, do, prefix, d_final, b=b: op(
            q, k, v, b, initial_state=prefix, return_final_state=True),
        f"prefix_fwdbwd[{b}]": lambda q, k, v, do, prefix, d_final, b=b: fwdbwd(
            q, k, v, (do, d_final), b, initial_state=prefix, return_final_state=True),
        f"states[{b}]": lambda q, k, v, do, prefix, d_final, b=b: states(k, v, b, False),
        f"states_reverse[{b}]": lambda q, k, v, do, prefix, d_final, b=b: states(q, do, b, True),
    })
  return found


def trace_sequence_parallel(shape, devices: int, out_dir: pathlib.Path, calls: int = 5) -> dict:
  """The N-device forward and forward+backward under the profiler: {mode: kernel_times}."""
  b, t, h, d = shape
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("sp",))
  rows = NamedSharding(mesh, P(None, "sp"))
  decay = jnp.asarray(lj.alibi_slopes(h))
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.device_put(jax.random.normal(key, (b, t * devices, h, d), jnp.bfloat16), rows) for key in keys)

  def attn(q, k, v):
    return lj.sharded_lightning_attention(q, k, v, decay, mesh=mesh, sequence_axis="sp", impl="pallas")

  def fwdbwd(q, k, v, do):
    o, vjp = jax.vjp(attn, q, k, v)
    return o, vjp(do)

  modes = {"fwd": jax.jit(attn), "fwdbwd": jax.jit(fwdbwd)}
  found = {}
  for mode, fn in modes.items():
    args = (q, k, v) if mode == "fwd" else (q, k, v, do)
    jax.block_until_ready(fn(*args))
    found[mode] = kernel_times.kernel_times(kernel_times.trace_calls(fn, args, calls, out_dir / f"trace-{mode}"),
                                            calls)
    for process, kernels in found[mode].items():
      print(f"{mode} {process}: {sum(kernels.values()):.3f} ms of kernels per call")
      for name, ms in list(kernels.items())[:12]:
        print(f"  {ms:8.3f} ms  {name[:100]}")
  return found


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shape", default="1x131072x32x128", help="one device's BxTxHxD")
  p.add_argument("--states-blocks", default="default", help="comma-separated default or DxExWARPSxSTAGES")
  p.add_argument("--trace-devices", type=int, help="trace the sequence-parallel programs of this many devices")
  p.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("."), help="where --trace-devices writes")
  args = p.parse_args(argv)
  shape = tuple(int(x) for x in args.shape.split("x"))
  if args.trace_devices:
    return trace_sequence_parallel(shape, args.trace_devices, args.out_dir)
  decay = jnp.asarray(lj.alibi_slopes(shape[2]))
  arg_sets = [_inputs(shape, seed) for seed in range(2)]
  times = {}
  for name, fn in programs(decay, args.states_blocks.split(",")).items():
    times[name] = pieces.time_ms(fn, arg_sets, max_seconds=0.5)
    print(f"{args.shape} {name:32s} {times[name]:8.3f} ms", flush=True)
  for b in args.states_blocks.split(","):
    fwd = times[f"states[{b}]"] + times[f"prefix_fwd[{b}]"]
    fwdbwd = times[f"states[{b}]"] + times[f"states_reverse[{b}]"] + times[f"prefix_fwdbwd[{b}]"]
    print(f"states blocks {b}: one device of sequence parallelism: forward {fwd:.3f} ms "
          f"({fwd / times[f'fwd[{b}]']:.2f}x the plain op), forward+backward {fwdbwd:.3f} ms "
          f"({fwdbwd / times[f'fwdbwd[{b}]']:.2f}x)")
  return times


if __name__ == "__main__":
  main()
