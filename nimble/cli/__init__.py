"""The ``nimble`` command line: one module per command, the bench harness and the bench models."""
