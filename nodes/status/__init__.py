"""What the pack is doing, for the browser and the run summary: per-node backend records (records.py),
the server routes (routes.py) and the Comfy Metal Status node (nodes.py). See records.py for the contract."""
from .records import (BACKEND_EVENT, RECORDER_ATTR, clear_records, dispatch_state, history, loaded_models, node_backends,
                      record_forward_kernels, record_loaded_model, record_node_backend, recording_kernels, records_since,
                      summarize_backends)
from .routes import (BACKEND_ENV, ROUTE_PREFIX, ROUTES, add_routes, force_reference_enabled, memory_info,
                     register_with_comfyui, set_force_reference, status_payload)
from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, MetalStatus, measured_table, status_report
from .summary import plain_summary, short_report

__all__ = ["BACKEND_EVENT", "RECORDER_ATTR", "clear_records", "dispatch_state", "history", "loaded_models",
           "node_backends", "record_forward_kernels", "record_loaded_model",
           "record_node_backend", "recording_kernels", "records_since", "summarize_backends", "BACKEND_ENV",
           "ROUTE_PREFIX", "ROUTES", "add_routes", "force_reference_enabled", "memory_info", "register_with_comfyui",
           "set_force_reference", "status_payload", "NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS",
           "MetalStatus", "measured_table", "status_report", "plain_summary", "short_report"]
