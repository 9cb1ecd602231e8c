"""The pool's lifecycle: the engines the gateway starts, resizes, relays out and restarts.

``manager`` owns the managed instances (``spec`` parses the pool file, ``layout`` places
instances on GPUs, ``instance`` is one engine process, ``restarts``/``drain``/``handover``
stop, drain and move them, ``relayouts`` logs the policy's layout changes, ``jobs`` the
admin jobs), ``keeper`` and ``checkpoint`` hold the weights every engine must serve,
``engines`` speaks vLLM's control routes and ``monitor`` samples every engine for the
status page. The request path (``gateway.proxy``, ``gateway.dispatch``) never imports it.
"""
