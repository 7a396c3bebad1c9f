"""The KV checkpoint store: incremental KV segments, commit records, per-request restore.

- ``store``: ``CheckpointStore``, the rules by which segments are applied and restores read (no network);
- ``segments``: what a writer streams and is told back (layout, writer, ack);
- ``commits``: a request's commit entry and which copy of the request owns it;
- ``kv_track``, ``media_track``: a request's KV and media embeddings, in memory and in its spill files;
- ``spill_files``, ``spill_outage``: writing spill files, and what the store does while the disk fails;
- ``server``, ``process``: the gRPC shell and the process around it.
"""
