"""Peer implementations, each family measured in its own subprocess.

    python -m benchmarks.peers.<name> --json-in JOBS.json --json-out RESULTS.jsonl

`fla` and `lightning_attn` are torch/Triton packages (`common.TorchBackend`),
`jla` is a JAX package (`benchmarks.jax_impls.JaxBackend`). A peer whose
package is not installed reports every job as skipped.
"""
