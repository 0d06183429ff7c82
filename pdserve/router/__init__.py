"""pdserve.router: the PD router (HTTP in front of prefill and decode servers).

app.py      FastAPI app: routes, auth, RouterConfig
metrics.py  /metrics through prometheus_client (counters and per-worker gauges)
proxy.py    one request to a prefill and a decode with a shared bootstrap room; another
            pair when that fails (migration), the watchdog, shedding
attempt.py  a request across its attempts (Run) and one pair's attempt (Attempt)
relay.py    a decode's stream block by block: token ids recorded, error events caught
legs.py     the two legs of a request (prefill read fully, decode relayed)
loops.py    background loops: a failing tick is logged, a dead loop is fatal
http1.py    the lean HTTP/1.1 client the two legs go through (keep-alive pool)
body.py     request bodies: bootstrap fields, sequence counts, error bodies
workers.py  the worker pool and its selection policies
webui.py    the web console: GET / and its static files (web/), GET /console/state
console.py  /console/state: the workers' /stats and the router's view in one JSON
cli.py      `pdserve router`
"""
