"""Nimble's own GPU kernels, as PTX the driver compiles when a graph is built (no toolkit needed).

Installed as ``nimble._kernels``; :mod:`nimble.engine.kernels` finds them in a source checkout or an install.
"""
