"""The OpenAI-compatible HTTP gateway: /v1/completions, /v1/chat/completions and /v1/models in front of the routers.

It calls the routers through the SDK (phalanx.client), so a router that dies
mid-stream costs the HTTP client nothing: the SDK resumes at the next token.
`auth`, `schema`, `responses` and `errors` are pure logic; `server` is the
FastAPI shell and `process` the lifecycle.
"""
