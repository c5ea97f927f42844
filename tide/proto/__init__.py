"""Generated gRPC/protobuf code for `protos/tide/v1/*.proto`.

The modules live in `tide.proto.tide.v1` (e.g. `from tide.proto.tide.v1 import inference_pb2,
inference_pb2_grpc`); they are produced by `python -m tide.proto.generate`, committed, and never
edited by hand. See `tide/proto/generate.py` for why the layout is `tide/proto/tide/v1`.
"""
