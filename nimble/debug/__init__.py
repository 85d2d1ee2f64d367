"""Debugging a prepared graph: the measured timeline, step-through and first divergence.
"""
