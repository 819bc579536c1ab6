"""The operator's tools, above everything else: the CLI, the cluster supervisor, the
demo, the engine verifier, and the ways the server is served (uvicorn options, the
in-process harness tests and benchmarks use)."""
