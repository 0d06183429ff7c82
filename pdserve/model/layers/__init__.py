"""The building blocks every architecture shares: linear projections (float and
quantized blocks), activations, rotary embeddings and the elementwise passes (norms,
residual adds) behind one small interface. Nothing here knows an architecture."""
