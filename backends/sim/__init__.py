"""Simulated vLLM: an engine on a calibrated latency model and an OpenAI-compatible server.

Public entry points (see each module's docstring for the why):

- ``profiles.load_profile`` / ``LatencyProfile``: per (model, GPU, TP) step-time constants.
- ``engine.EngineCore`` + ``request.SimRequest``: the synchronous engine for the
  discrete-event simulator; ``clock.VirtualClock`` / ``clock.WallClock``.
- ``driver.SimEngine``: the engine on a clock, for servers.
- ``server.create_sim_app`` / ``state.SimServerConfig``: one HTTP server.
- ``runner.start_sim_servers`` / ``runner.run_sim_backends``: many servers, one process.
- ``tokenizer.get_tokenizer`` / ``chat.render_chat``: the round-trip-exact tokenizer.
"""
