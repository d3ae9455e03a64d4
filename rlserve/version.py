"""The release, one place: the CLI's --version, the API's /version, the package's __version__."""

__version__ = "0.1.0"
