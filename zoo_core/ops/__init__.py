"""The shared maths of the zoo: pure jnp forms (linear attention, packing, context parallelism, masks,
positions) and the small Flax helpers (dropout, remat) that two packages need."""
