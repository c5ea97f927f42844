"""gRPC TrainerService: translates tide.v1 protobuf <-> the trainer's domain.

TriggerTraining (admin: bearer token, enforced by tide.grpcutil) starts a run on the buffered
chunks: `accepted=false` with a detail when a run is already going (its run id is returned) or
there is not enough data. It fails with FAILED_PRECONDITION when the training library or the target
cannot be loaded here, UNAVAILABLE while the target is still being prepared, INVALID_ARGUMENT for
a target this trainer does not train. GetStatus reports intake counters, the state of the current
run (STATE_TRAINING while the base draft is fetched and the candidate trained and evaluated,
STATE_EVALUATING while it is compared, registered and promoted), its progress by phase, the latest
training loss, the last outcome and the governed store's counters (deletions by reason, quarantined
blobs, the bucket's chunk bytes against its budget). ForgetData and SweepData (admin) call
governance.py's `forget` and `sweep`.
"""

from __future__ import annotations

import dataclasses
import logging

import grpc

from services.trainer.runs import TargetNotReady, TrainingOutcome, TrainingUnavailable, WrongTarget
from tide.grpcutil import GrpcServer
from tide.proto.tide.v1 import trainer_pb2, trainer_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "tide.v1.TrainerService"
_STATES = {"idle": trainer_pb2.TrainerStatus.STATE_IDLE, "training": trainer_pb2.TrainerStatus.STATE_TRAINING,
           "evaluating": trainer_pb2.TrainerStatus.STATE_EVALUATING}


def outcome_pb(o: TrainingOutcome) -> trainer_pb2.TrainingOutcome:
    return trainer_pb2.TrainingOutcome(**dataclasses.asdict(o))


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, service) -> None:  # services.trainer.app.TrainerService
        self.service = service

    def TriggerTraining(self, request, context):
        try:
            r = self.service.runner.trigger(request.target_model, request.reason, request.force)
        except WrongTarget as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except TargetNotReady as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except TrainingUnavailable as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return trainer_pb2.TriggerTrainingResponse(accepted=r.accepted, run_id=r.run_id, detail=r.detail)

    def GetStatus(self, request, context):
        s = self.service
        st = s.runner.status()
        chunks, tokens = s.manifest.buffered_totals(st.target_model or None)
        out = trainer_pb2.TrainerStatus(
            state=_STATES[st.state], run_id=st.run_id, target_model=st.target_model, buffered_chunks=chunks,
            buffered_tokens=tokens, chunks_consumed=s.ingest.stats.accepted,
            chunks_deduplicated=s.ingest.stats.deduplicated,
            chunks_dead_lettered=s.reader.consumer.stats.dead_lettered, progress=st.progress, loss=st.loss)
        g = s.governor
        if g is not None:
            for reason, n in g.stats.deleted.items():
                out.chunks_deleted[reason] = n
            out.chunk_bytes_deleted = sum(g.stats.deleted_bytes.values())
            out.bucket_chunk_bytes, out.bucket_budget_bytes = g.stats.bucket_bytes, g.policy.budget_bytes
            out.stream_entries_trimmed = g.stats.stream_trimmed
        out.chunks_quarantined = quarantined(s)
        if st.last_outcome is not None:
            out.last_outcome.CopyFrom(outcome_pb(st.last_outcome))
        return out

    def ForgetData(self, request, context):
        g = self.service.governor
        if g is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this trainer has no data governor")
        which = request.WhichOneof("what")
        if which is None or not getattr(request, which):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "give a request_id or a key_id")
        r = g.forget(**{which: getattr(request, which)})
        return trainer_pb2.ForgetDataResponse(chunks_deleted=r.chunks_deleted, chunks_rewritten=r.chunks_rewritten,
                                              rows_removed=r.rows_removed, requests_removed=r.requests_removed,
                                              stream_entries_deleted=r.stream_entries_deleted,
                                              memory_notice=r.memory_notice)

    def SweepData(self, request, context):
        g = self.service.governor
        if g is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this trainer has no data governor")
        done = g.sweep()
        return trainer_pb2.SweepDataResponse(chunks_deleted=done, bucket_chunk_bytes=g.stats.bucket_bytes,
                                             bucket_chunks=g.stats.bucket_chunks)


def quarantined(service) -> int:
    """Sealed blobs that failed authentication: at intake (dead-lettered) and when a run read them."""
    cycle = getattr(service.runner, "cycle", None)
    return service.ingest.stats.quarantined + int(getattr(cycle, "quarantined", 0))


def serve(service, address: str, admin_token: str | None, max_workers: int = 16) -> GrpcServer:
    server = GrpcServer(address, admin_token=admin_token, max_workers=max_workers)
    server.add_service(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, TrainerServicer(service), SERVICE_NAME)
    server.start()
    return server
