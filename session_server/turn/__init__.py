"""One chat turn, from the request body to the committed tokens and the response: read,
replay-check, prepare, dispatch to an engine, stream, validate and commit."""
