"""gRPC TrainerService: translates tide.v1 protobuf <-> the trainer's domain.

TriggerTraining (admin: bearer token, enforced by tide.grpcutil) starts a run on the buffered
chunks: `accepted=false` with a detail when a run is already going (its run id is returned) or
there is not enough data. It fails with FAILED_PRECONDITION when the training library or the target
cannot be loaded here, UNAVAILABLE while the target is still being prepared, INVALID_ARGUMENT for
a target this trainer does not train. GetStatus reports intake counters, the state of the current
run (STATE_TRAINING while the base draft is fetched and the candidate trained and evaluated,
STATE_EVALUATING while it is compared, registered and promoted), its progress by phase, the latest
training loss, and the last outcome.
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
        if st.last_outcome is not None:
            out.last_outcome.CopyFrom(outcome_pb(st.last_outcome))
        return out


def serve(service, address: str, admin_token: str | None, max_workers: int = 16) -> GrpcServer:
    server = GrpcServer(address, admin_token=admin_token, max_workers=max_workers)
    server.add_service(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, TrainerServicer(service), SERVICE_NAME)
    server.start()
    return server
