"""The OpenAI-compatible surface: request parsing and bounds (request), response shapes (shapes), tool-call
formats (tools), the chat-completion call on the engine (completions) and the HTTP server (server, http).

Dependency rule: api imports core and store, never apps. tests/test_layout.py checks it.
"""
