"""Prometheus metrics of the inference service, defined once per process (default registry).

The classes that move them also keep plain integer counters of their own (`.stats`), which tests
and the status call read; these module-level series are what `/metrics` exports.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("tide_inference_requests", "Generate requests by outcome", ["outcome"])
GENERATED_TOKENS = Counter("tide_inference_generated_tokens", "Tokens emitted to clients")
PROMPT_TOKENS = Counter("tide_inference_prompt_tokens", "Prompt tokens of admitted requests")
PROMPT_TOKENS_CACHED = Counter("tide_inference_prompt_tokens_cached",
                               "Of those, tokens the prefix cache served (not prefilled again)")
PREFIX_HOST_TOKENS = Gauge("tide_inference_prefix_cache_host_tokens",
                           "Tokens whose KV entries the prefix cache holds in host memory")
STEPS = Counter("tide_inference_steps", "Engine steps run")
DRAFT_PROPOSALS = Counter("tide_inference_draft_proposals", "Speculative proposals of EAGLE-3 with prompt lookup, by "
                          "source: copy (the context repeated) or draft (the EAGLE-3 draft's)", ["source"])
STEP_ERRORS = Counter("tide_inference_step_errors", "Engine steps that raised (requests in flight failed)")
DECISIONS = Counter("tide_inference_decisions", "Controller decisions by outcome", ["outcome"])
RUNNING = Gauge("tide_inference_running_requests", "Sequences holding a KV slot")
WAITING = Gauge("tide_inference_waiting_requests", "Accepted requests without a KV slot yet")
KV_USAGE = Gauge("tide_inference_kv_cache_usage", "Fraction of KV-cache slots in use [0, 1]")
# One series per estimate of the γ policy (tide.policies.Estimate): alpha_global, depth_ratio{depth=j},
# kappa_verify / kappa_draft / kappa_catchup {batch=B[,tokens=n]} (measured over profiled ms), refreshed
# about once a second; empty for a policy without estimates (static-γ).
POLICY_ESTIMATE = Gauge("tide_inference_policy_estimate", "The γ policy's online estimates",
                        ["policy", "name", "scope"])
# Output constraints compiled at submit (tide.engine.constraints; ~1 ms each on the reference CPU).
GRAMMAR_COMPILE = Histogram("tide_inference_grammar_compile_seconds",
                            "Output-constraint compile time per constrained request (0: the grammar was cached)",
                            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0))
COLLECTION = Gauge("tide_inference_collection_enabled", "1 while hidden-state collection is on")

TELEMETRY_PUBLISHED = Counter("tide_telemetry_records_published", "Step records written to the telemetry stream")
TELEMETRY_DROPPED = Counter("tide_telemetry_records_dropped", "Step records dropped (buffer full: oldest first)")
TELEMETRY_ERRORS = Counter("tide_telemetry_publish_errors", "Failed telemetry XADD batches (Redis unreachable)")
TELEMETRY_BUFFERED = Gauge("tide_telemetry_records_buffered", "Step records waiting to be published")

CHUNKS_WRITTEN = Counter("tide_chunks_written", "Hidden-state chunks stored in S3 and announced on the stream")
CHUNK_TOKENS = Counter("tide_chunk_tokens_exported", "Token rows in announced chunks")
CHUNK_TOKENS_DROPPED = Counter("tide_chunk_tokens_dropped", "Token rows dropped before reaching S3", ["reason"])
# reasons: invalid, spool_evicted (spooled, then evicted oldest first for a newer chunk), spool_full (no room
# even evicting), spool_error, spool_corrupt, s3 (no spool), ref_queue_full (blob stored, ref
# dropped while Redis was down: the trainer's reconciler re-enqueues it)
CHUNKS_DROPPED = Counter("tide_chunks_dropped", "Chunks dropped before or after S3", ["reason"])
CHUNK_BYTES = Counter("tide_chunk_bytes_written", "Bytes of chunk blobs written to S3")
CHUNKS_SPOOLED = Counter("tide_chunks_spooled", "Chunks written to the local spool because S3 writes failed")
CHUNKS_UNSPOOLED = Counter("tide_chunks_unspooled", "Spooled chunks uploaded to S3 once it answered again")
SPOOL_DELETED = Counter("tide_chunk_spool_deleted", "Spooled chunks deleted before S3 took them", ["reason"])
# reason: budget (the oldest, evicted for a newer chunk when the spool is at TIDE_CHUNK_SPOOL_BYTES)
SPOOL_BYTES_DELETED = Counter("tide_chunk_spool_deleted_bytes", "Bytes of spooled chunks deleted before S3 took them",
                              ["reason"])
SPOOL_BYTES = Gauge("tide_chunk_spool_bytes", "Bytes in the chunk spool (chunks waiting for S3, refs for Redis)")
SPOOL_ENTRIES = Gauge("tide_chunk_spool_entries", "Spool entries: chunk = waiting for S3, ref = waiting for Redis",
                      ["kind"])
# TIDE_SPECULATION_MEMORY_FLEET (fleet_memory.FleetMemory.stats): published, publish_dropped,
# publish_errors, read_errors, added, own, other_target, corrupt
FLEET_MEMORY = Counter("tide_inference_fleet_memory_entries", "Fleet speculation-memory entries by what happened",
                       ["outcome"])
# Deletion requests for the speculation memory (memory_forget.MemoryForgetter.stats): applied,
# corrupt, failed, read_errors notices, and `documents` for the documents they dropped
MEMORY_FORGET = Counter("tide_inference_memory_forget", "Speculation-memory forget notices (and documents "
                        "dropped) by outcome", ["outcome"])
