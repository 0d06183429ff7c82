"""The prefill's side of the KV transfer: KVSender, a `KVSink` that pushes KV to decodes.

sender.py     KVSender: the engine's calls, rooms' lifecycle, timers
bootstrap.py  what decodes say on its ROUTER (Announce, Ready, Ack, Abort, Heartbeat)
peers.py      bounds on what a peer can make it keep; its PUSH sockets to decodes
room.py       one room's state
pieces.py     a room's KV as frame-sized pieces; the pieces sent in place from the pool
push.py       Pusher: a room's KVChunk / KVDone messages onto a PUSH socket
staging.py    staging buffers a piece is gathered into
release.py    a room's release to the engine, once libzmq reads none of its pages

Imports the common layer (transfer/'s top-level modules), never receiving/.
"""
