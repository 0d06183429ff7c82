"""Attention over the paged KV pool: the plan of a batch (which rows, which pages),
the torch and native CPU backends, the Triton backend for CUDA, and the registry that
picks one for an engine."""
