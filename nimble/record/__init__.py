"""Recording: capture a model's forward (or training step) on one stream, trace its ops,
decode every node and resolve its pointers into a TaskGraph.
"""
