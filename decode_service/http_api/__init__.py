"""OpenAI-compatible HTTP front (`inkling-epd api`): `/v1/chat/completions`, `/v1/completions`, `/v1/models`,
`/health`, `/metrics`, translated onto the gRPC `Generator` of a router or decode replica.

Transport only: no torch, no engine. `protocol` parses OpenAI JSON into a `GenerateRequest`, `responses`
renders the `Generate` stream back as OpenAI JSON / SSE chunks, `errors` maps gRPC status codes to OpenAI's
error JSON in one place, `media` resolves image/audio/video URLs, `app` wires the routes, `server` runs uvicorn.
"""
