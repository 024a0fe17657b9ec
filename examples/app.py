"""The example application the docs and the deploy examples name (``--app examples.app``,
in a clone of the repository): the demo's, which is installed with qcluster as
``qcluster.demo.app`` (demo/app.py in the repository)."""

from qcluster.demo.app import app

__all__ = ["app"]
