"""`python -m lightning_jax.tune`: see `lightning_jax.tune`."""

from lightning_jax.tune import main

main()
