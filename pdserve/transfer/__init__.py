"""pdserve.transfer: the prefill -> decode KV transfer over ZeroMQ (docs/architecture.md §5).

messages.py   wire types (msgspec, tagged, versioned)
checksum.py   XXH3-64 block checksums and the transfer digest
zmq_io.py     the one typed ZeroMQ wrapper (sockets, send hook, CURVE keys)
io_thread.py  the background I/O thread both sides run their sockets on
sender.py     KVSender: the prefill's KVSink        (push.py, staging.py)
receiver.py   KVReceiver: the decode's KVSource     (validate.py)
faults.py     seeded fault injection in the send path
curve.py      optional CURVE encryption + ZAP authentication
loopback.py   a model-free prefill/decode pair for tests and benchmarks
stages.py     seconds spent per transfer stage (benchmarks/kv_transfer.py)
heap.py       keeps freed frames mapped (glibc malloc thresholds), set per engine process
"""
