"""The status page: static assets (HTML, JS, CSS, SVG) the gateway serves at ``GET /``.

A package only so that the assets ship inside the wheel next to ``gateway`` and are found
with ``importlib.resources`` both in a checkout and when installed. No build step: plain
JavaScript and SVG, no third-party front-end code.
"""
