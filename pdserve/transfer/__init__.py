"""pdserve.transfer: the prefill -> decode KV transfer over ZeroMQ (docs/architecture.md §5).

By side (each imports the common layer below, never the other side):

sending/      KVSender: the prefill's KVSink
receiving/    KVReceiver: the decode's KVSource

Common layer (imports neither side):

base.py       the ports: KVSink, KVSource, Ticket and their events
handoff.py    the in-process implementation of both ports (offline LLM, unit tests)
messages.py   wire types (msgspec, tagged, versioned)
checksum.py   XXH3-64 block checksums and the transfer digest
identity.py   the model fingerprint both sides must agree on
pages.py      a pool's K and V as pages, a request's slots as pages
zmq_io.py     the one typed ZeroMQ wrapper (sockets, send hook, CURVE keys)
zmq_native.py KV frames sent through libzmq's C API (native/zmq_send.c)
io_thread.py  the background I/O thread both sides run their sockets on
curve.py      optional CURVE encryption + ZAP authentication
faults.py     seeded fault injection in the send path
loopback.py   a model-free prefill/decode pair for tests and benchmarks
stages.py     seconds spent per transfer stage (benchmarks/kv_transfer.py)
heap.py       keeps freed frames mapped (glibc malloc thresholds), set per engine process
"""
