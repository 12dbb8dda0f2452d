"""The execution side: the model runner (tensors), the sampler, grammar constraints and
incremental detokenization."""
