"""Recording: capture a model's forward (or training step) on one stream, trace its ops,
decode every node and resolve its pointers into a TaskGraph.

:mod:`~nimble.record.recorder` holds the entry points (``record()``, ``record_step()``) and the
:class:`~nimble.record.recorder.Recording` they return; :mod:`~nimble.record.capture` captures
the phases with the op tracer (:mod:`~nimble.record.tracer`, which also follows the Triton
kernels of a module compiled by ``torch.compile``: :mod:`~nimble.record.compiled`) and the
allocator's history; :mod:`~nimble.record.twin` captures them again at other addresses as
evidence for pointers; :mod:`~nimble.record.decode` reads every graph node.  What that gathers on
the GPU is plain data (:mod:`~nimble.record.raw`), which :mod:`~nimble.record.resolve` (with
:mod:`~nimble.record.pointers` and :mod:`~nimble.record.intervals`) turns into a TaskGraph on any
machine; :mod:`~nimble.record.rng_cells` then finds, by one replay, where the random kernels read
the generator's seed and offset.
"""
