"""Request state, pools, FutureMap, prefill and decode schedulers, the overlap loop."""
