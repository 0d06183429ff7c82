"""The decode's side of the KV transfer: KVReceiver, a `KVSource` that takes KV from
prefills.

receiver.py   KVReceiver: the engine's calls, control messages, timers
control.py    its DEALER sockets to prefills, bounded
data.py       what comes on its PULL: a chunk goes payload -> validate -> writer
transfer.py   one transfer's state: reservation, coverage map, where its rows go
payload.py    a received chunk's frames cut as its header names them
validate.py   the checks, pure: why a chunk or KVDone must be refused
writer.py     a checked chunk into the reserved slots

Imports the common layer (transfer/'s top-level modules), never sending/.
"""
