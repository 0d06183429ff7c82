"""pdserve.kvcache: request-to-token rows, the paged KV pool and its layout (the bottom
of the stack: it imports nothing of pdserve)."""
