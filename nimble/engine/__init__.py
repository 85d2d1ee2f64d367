"""The engine: build the scheduled graph on the driver, Nimble's own kernels, task timing, the
prepared graph, the per-call launcher, weights, the proof and the autograd glue.
"""
