"""Weight updates and staleness, apart from the request path.

So far the live-call table (``live``): which calls have an upstream request open on
which engine, what a weight update waits on and does to each. It is a typed field of the
runtime (``Runtime.live_calls``), so it sits below ``gateway.runtime`` and imports
nothing of the proxy.
"""
