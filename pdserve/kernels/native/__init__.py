"""Native CPU kernels: each C source here beside the Python module that calls it.

library.py      builds a source once per machine into the cache, loads it (ctypes)
par.py          par.c: a kernel's range function run in parts on spinning workers
paged_decode.py, linear_f32.py, decode_ops.py, decode_forward.py, page_copy.py:
                the wrapper of the C file of the same name
"""
