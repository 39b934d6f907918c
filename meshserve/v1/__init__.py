"""The wire API, version 1: inference.proto and the stubs grpcio-tools generates from it.

`inference_pb2*` are generated (`python -m meshserve.api.protogen`); do not edit them.
"""
