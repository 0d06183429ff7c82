"""pdserve.edge: the HTTP edge shared by the frontends (`server/`) and the router
(`router/`), below both: request-body bounds and how a listener starts.

bounds.py   numeric bounds of request bodies (finite floats, int64, seeds, rooms)
listen.py   `serve`: the one way a pdserve HTTP server starts (exposure warning,
            quiet health polls)
"""
