"""pdserve.edge: the HTTP edge shared by the frontends (`server/`) and the router
(`router/`), below both: request-body bounds and how a listener starts.

auth.py     the API key on every route but /health (constant-time comparison)
body.py     the one request-body reader (size limit, JSON, bounds)
bounds.py   numeric bounds of request bodies (finite floats, int64, seeds, rooms)
errors.py   the OpenAI-style error body, ClientGone
listen.py   `serve`: the one way a pdserve HTTP server starts (exposure warning,
            quiet health polls)
stamps.py   the router's and the frontends' time stamps of a request (TTFT breakdown)
"""
