"""The OpenAI-compatible HTTP server."""

__all__ = ["create_app"]


def __getattr__(name):
    # The app pulls in FastAPI and the engine; the CLI imports light modules from here.
    if name == "create_app":
        from rlserve.server.app import create_app
        return create_app
    raise AttributeError(name)
