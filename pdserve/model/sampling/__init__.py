"""From logits to the next token: the batched pick (greedy, temperature, top-k/top-p,
seeds, logprobs), repetition penalties and grammar masks."""
