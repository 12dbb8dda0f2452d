"""The scheduling side, plain Python over ints and lists (no torch): requests, the block
pool, the radix cache, the waiting-queue policy, the scheduler and the step plan it emits."""
