"""The only package that calls ``cuda.bindings.driver``.

Every driver call goes through :func:`call` (or :func:`probe`, for calls whose failure is an
answer), which unwraps the ``(CUresult, *values)`` tuple and raises :class:`CudaError` naming the
call and the ``CUDA_ERROR_*`` code.  Every handle Nimble creates has exactly one owner here; it is
freed by an idempotent ``close()`` or, failing that, by a ``weakref.finalize`` that never raises.

Importing this package does not touch the GPU: the bindings are imported on first use.  Its
modules: :mod:`~nimble.driver.calls` (the bindings, checked calls, the context),
:mod:`~nimble.driver.nodes` (graphs and their nodes, launches, copies),
:mod:`~nimble.driver.handles` (the owned handles and device memory) and
:mod:`~nimble.driver.graphs` (graphs another library owns, read by their raw handle).  The
rest of Nimble uses the names re-exported here (``driver.call``, ``driver.GraphExec``, ...).
"""
from __future__ import annotations

from .calls import (bindings, call, checked_status, context_fault, current_context,
                    device_attributes, device_supports_stream_writes, ensure_context, probe,
                    raise_status, synchronize_context, use_context)
from .edges import GraphEdge, add_programmatic_dependencies, graph_edges, programmatic_pairs
from .graphs import borrowed_graph, graph_nodes_of, node_count_of, programmatic_edges_of
from .handles import (DeviceMemory, Event, Graph, GraphExec, LowBitsMemory, Module, close_all,
                      nimble_memory)
from .nodes import (CallPath, add_dependencies, add_empty_node, add_event_node_like,
                    add_event_record_node,
                    add_kernel_node, add_memcpy_node, add_memset_node, address_range,
                    allow_dynamic_shared, capture_graph, copy_device, copy_kernel_attributes,
                    copy_to_device, copy_to_host, event_elapsed_ms, event_synchronize,
                    fill_bytes_async, function_name, function_param_layout, graph_nodes,
                    kernel_function_of, kernel_node_params, kernel_priority, launch,
                    memcpy_node_params, memset_node_params, node_count, node_type, read_host,
                    record_event, set_exec_kernel_params, set_kernel_priority, stream,
                    stream_priority_range, stream_synchronize, upload)
# The nodes Nimble builds from its own kernels and from recorded nodes.
from .nodes import (add_function_node, add_kernel_node_like, add_memcpy_node_like,
                    add_memset_node_like, kernel_arguments, set_exec_kernel_arguments)
# Nodes rebuilt from stored descriptions, kernels loaded from their binaries, and the images of
# the modules this process loads (kept for saving graphs).
from . import module_images
from .stored import (SETTABLE_ATTRIBUTES, Library, ProcessBoundNode, StoredNode,
                     device_architecture, driver_version, function_attributes,
                     function_fingerprint, kernel_node_attributes, memcpy_fields, memset_fields,
                     set_function_attributes)
# What a kernel takes of an SM.
from .nodes import FunctionResources, function_resources, max_active_blocks

__all__ = [
    "CallPath", "DeviceMemory", "Event", "Graph", "GraphExec", "LowBitsMemory", "Module",
    "add_dependencies", "add_empty_node", "add_event_node_like", "add_event_record_node",
    "add_kernel_node",
    "add_memcpy_node", "add_memset_node", "address_range", "allow_dynamic_shared", "bindings",
    "call", "capture_graph", "checked_status", "close_all", "context_fault",
    "copy_device", "copy_kernel_attributes", "copy_to_device", "copy_to_host", "current_context",
    "device_attributes", "device_supports_stream_writes", "ensure_context", "event_elapsed_ms",
    "event_synchronize", "fill_bytes_async", "function_name", "function_param_layout",
    "graph_nodes", "kernel_function_of", "kernel_node_params", "kernel_priority", "launch",
    "memcpy_node_params", "memset_node_params", "nimble_memory", "node_count", "node_type",
    "probe", "raise_status", "read_host", "record_event", "set_exec_kernel_params",
    "set_kernel_priority", "stream", "stream_priority_range", "stream_synchronize",
    "synchronize_context", "upload", "add_function_node", "add_kernel_node_like",
    "add_memcpy_node_like", "add_memset_node_like", "kernel_arguments",
    "set_exec_kernel_arguments", "borrowed_graph", "graph_nodes_of", "node_count_of",
    "programmatic_edges_of", "programmatic_pairs", "add_programmatic_dependencies", "graph_edges",
    "GraphEdge",
    "FunctionResources", "function_resources", "max_active_blocks",
    "SETTABLE_ATTRIBUTES", "Library", "ProcessBoundNode", "StoredNode", "device_architecture",
    "driver_version", "function_attributes", "function_fingerprint", "kernel_node_attributes",
    "memcpy_fields", "memset_fields", "set_function_attributes", "module_images",
    "use_context",
]
