"""`treespec serve`: an OpenAI-compatible HTTP server over the continuous-batching engine.

    app.py       the FastAPI app (`create_app`) and its state (`Server`): requests built, run, answered
    routes.py    the routes: /v1/completions, /v1/chat/completions, /v1/models; /, /health, /metrics
    errors.py    how every error is answered (OpenAI's error body), the app's exception handlers
    protocol.py  request and response bodies (pydantic), the error body, finish reasons
    body.py      reading a body: JSON within limits, then pydantic, then unsupported fields (400s)
    loop.py      the engine thread: one thread steps the Engine; handlers talk to it via queues
    metrics.py   Prometheus metrics (one registry per app)
    cli.py       the command's flags (`add_arguments`) and `run`

Streamed text goes through `treespec.output.TextStream` (no half characters, OpenAI stops).
docs/serving.md is the reference. The app is imported from `treespec.serve.app` (FastAPI and
the models load only when the server starts).
"""
