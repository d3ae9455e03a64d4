"""The OpenAI-compatible HTTP server."""

from rlserve.server.app import create_app

__all__ = ["create_app"]
